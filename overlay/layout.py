"""The physical layout of a layer's expert weights, as a value the adapter owns.

Canonical: `w13 [E, 2I, H]` (gate rows, then up rows), `w2 [E, H, I]`, scales in
QuantSpec's canonical shapes, biases `w13_bias [E, 2I]`, `w2_bias [E, H]`.
A backend's layout is canonical plus a list of reversible steps, applied in the
order below; `to_layout` and `to_canonical` are exact inverses (one exception:
fp8 e4m3fn -> e4m3fnuz maps -0 to +0, which e4m3fnuz cannot hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import LayoutMismatchError, SpecError
from .quant import E8M0_BIAS
from .spec import FP8_FORMATS, MXFP4_GROUP, MoESpec

Tensors = dict[str, torch.Tensor]
GATE_UP_ORDERS = ("gate_up", "up_gate", "interleaved")
SHUFFLE_BYTES = 16  # a shuffle tile's inner run is 16 bytes, whatever the dtype


@dataclass(frozen=True)
class Layout:
    """Every parameter of a physical form; two layouts are equal only if all are."""

    name: str = "canonical"
    fp8_format: str | None = None  # physical fp8 flavour when it differs from the checkpoint's
    padded_intermediate: int | None = None  # physical I (zero rows/cols beyond the logical I)
    padded_hidden: int | None = None  # physical H
    gate_up: str = "gate_up"
    shuffle: tuple[int, int] | None = None  # (N tile, K tile) of a tile shuffle, e.g. AITER's (16, 16)
    transposed: bool = False  # weights stored [E, K, N]; scales stay canonical
    mx_scale_shuffle: bool = False  # mxfp4 e8m0 scales in 32-row x 8-group tiles (see shuffle_mx_scales)
    mx_words: bool = False  # mxfp4 e2m1 recoded into int32 words, 16 rows x 64 K together (see mx_words)
    mx_units: tuple[str, ...] = ()  # mxfp4 weights (w13, w2) recoded into int16 units of four (see mx_units)

    def __post_init__(self) -> None:
        if self.gate_up not in GATE_UP_ORDERS:
            raise SpecError(f"gate_up order {self.gate_up!r} is not one of {GATE_UP_ORDERS}")
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise SpecError(f"fp8 format {self.fp8_format!r} is not one of {sorted(FP8_FORMATS)}")

    @property
    def is_canonical(self) -> bool:
        return self == CANONICAL

    def __str__(self) -> str:
        if self.is_canonical:
            return "canonical"
        parts = [self.name]
        if self.fp8_format:
            parts.append(self.fp8_format)
        if self.padded_intermediate or self.padded_hidden:
            parts.append(f"pad(I={self.padded_intermediate}, H={self.padded_hidden})")
        if self.gate_up != "gate_up":
            parts.append(self.gate_up)
        if self.shuffle:
            parts.append(f"shuffle{self.shuffle[0]}x{self.shuffle[1]}")
        if self.transposed:
            parts.append("transposed")
        if self.mx_scale_shuffle:
            parts.append("mx-scale-shuffle")
        if self.mx_words:
            parts.append("mx-words")
        if self.mx_units:
            parts.append(f"mx-units({','.join(self.mx_units)})")
        return "/".join(parts)


CANONICAL = Layout()


# -- steps: each a forward and an inverse over the dict of tensors --------------------------


def _convert_fp8(t: Tensors, spec: MoESpec, target: str, inverse: bool) -> Tensors:
    """Reinterpret e4m3fn bits as e4m3fnuz (half the value) and double the scales, or back."""
    if spec.quant.weights != "fp8" or target == spec.quant.fp8_format:
        return t
    if (spec.quant.fp8_format, target) != ("e4m3fn", "e4m3fnuz"):
        raise SpecError(f"fp8 conversion {spec.quant.fp8_format} -> {target} is not supported")
    out = dict(t)
    src, dst = (FP8_FORMATS[target], FP8_FORMATS["e4m3fn"]) if inverse else (
        FP8_FORMATS["e4m3fn"], FP8_FORMATS[target])
    for name in ("w13", "w2"):
        bits = t[name].view(torch.int8)
        if not inverse:
            bits = bits.masked_fill(bits == -128, 0)  # -0 in e4m3fn is NaN in e4m3fnuz
        assert t[name].dtype == src, f"{name} is {t[name].dtype}, expected {src}"
        out[name] = bits.view(dst)
        factor = 0.5 if inverse else 2.0
        out[f"{name}_scale"] = t[f"{name}_scale"] * factor
    return out


def _pad_rows(x: torch.Tensor, dim: int, size: int, fill: int = 0) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_full(shape, fill)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _pad(t: Tensors, spec: MoESpec, layout: Layout, inverse: bool) -> Tensors:
    i_phys = layout.padded_intermediate or spec.intermediate_size
    h_phys = layout.padded_hidden or spec.hidden_size
    if (i_phys, h_phys) == (spec.intermediate_size, spec.hidden_size):
        return t
    if spec.quant.weights not in ("none",) and not (
        spec.quant.weights == "fp8" and spec.quant.granularity == "tensor"
    ):
        raise SpecError(f"padding is not supported for {spec.quant} weights")
    if i_phys < spec.intermediate_size or h_phys < spec.hidden_size:
        raise SpecError(f"padded sizes I={i_phys}, H={h_phys} are below the logical sizes")
    i, h = (spec.intermediate_size, spec.hidden_size) if inverse else (i_phys, h_phys)
    out = dict(t)
    gate, up = t["w13"].chunk(2, dim=1)
    out["w13"] = torch.cat([_fit(gate, i, h), _fit(up, i, h)], dim=1)
    out["w2"] = _fit(t["w2"], h, i)
    if "w13_bias" in t:
        gb, ub = t["w13_bias"].chunk(2, dim=1)
        out["w13_bias"] = torch.cat([_fit1(gb, i), _fit1(ub, i)], dim=1)
        out["w2_bias"] = _fit1(t["w2_bias"], h)
    return out


def _fit(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Crop or zero-pad the last two dims of `x` to (rows, cols)."""
    x = x[..., :rows, :cols]
    return _pad_rows(_pad_rows(x, -2, rows), -1, cols).contiguous()


def _fit1(x: torch.Tensor, size: int) -> torch.Tensor:
    return _pad_rows(x[..., :size], -1, size).contiguous()


def _gate_up_perm(two_i: int, order: str, device: torch.device) -> torch.Tensor:
    """Row permutation p such that new_rows = old_rows[p] (old rows: gate then up)."""
    half = two_i // 2
    idx = torch.arange(two_i, device=device)
    if order == "up_gate":
        return torch.cat([idx[half:], idx[:half]])
    return torch.stack([idx[:half], idx[half:]], dim=1).flatten()  # interleaved


def _reorder_gate_up(t: Tensors, spec: MoESpec, order: str, inverse: bool) -> Tensors:
    if order == "gate_up":
        return t
    out = dict(t)
    two_i = t["w13"].shape[1]
    perm = _gate_up_perm(two_i, order, t["w13"].device)
    if inverse:
        perm = torch.argsort(perm)
    out["w13"] = t["w13"].index_select(1, perm)
    if "w13_bias" in t:
        out["w13_bias"] = t["w13_bias"].index_select(1, perm)
    granularity = spec.quant.granularity
    if granularity == "channel":
        out["w13_scale"] = t["w13_scale"].index_select(1, perm)
    elif granularity == "block" or spec.quant.weights == "mxfp4":
        raise SpecError(f"gate/up order {order!r} is not supported with {spec.quant} weights")
    return out


def _shuffle_view(shape: torch.Size, tile: tuple[int, int], elem_bytes: int) -> tuple[int, ...]:
    n, k = shape[-2], shape[-1]
    tile_n, tile_k = tile
    run = SHUFFLE_BYTES // elem_bytes
    block_k = 2 * tile_k
    if n % tile_n or k % block_k or block_k % run:
        raise SpecError(
            f"tile shuffle {tile} needs N % {tile_n} == 0 and K % {block_k} == 0 on the last two "
            f"dims; got N={n}, K={k}"
        )
    return (-1, n // tile_n, tile_n, k // block_k, block_k // run, run)


def shuffle_tiles(x: torch.Tensor, tile: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """Tile shuffle of the last two dims `[N, K]`: within each `tile_n x 2*tile_k` tile,
    16-byte runs of K are laid out run-major, so one 16-row column of runs is contiguous."""
    view = x.reshape(_shuffle_view(x.shape, tile, x.element_size()))
    return view.permute(0, 1, 3, 4, 2, 5).contiguous().view(x.shape)


def unshuffle_tiles(x: torch.Tensor, tile: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """Inverse of `shuffle_tiles`."""
    _, nt, tn, kt, runs, run = _shuffle_view(x.shape, tile, x.element_size())
    view = x.reshape(-1, nt, kt, runs, tn, run)
    return view.permute(0, 1, 4, 2, 3, 5).contiguous().view(x.shape)


def _shuffle(t: Tensors, tile: tuple[int, int] | None, inverse: bool) -> Tensors:
    if tile is None:
        return t
    fn = unshuffle_tiles if inverse else shuffle_tiles
    return {**t, "w13": fn(t["w13"], tile), "w2": fn(t["w2"], tile)}


MX_SCALE_TILE = (32, 8)  # (rows, scale groups) of one tile of shuffled e8m0 scales


def _mx_scale_view(shape: torch.Size) -> tuple[int, ...]:
    e, n, groups = shape
    rows, cols = MX_SCALE_TILE
    if n % rows or groups % cols:
        raise SpecError(f"mxfp4 scale shuffle needs rows % {rows} == 0 and groups % {cols} == 0; got {n}, {groups}")
    return (e, n // rows, 2, rows // 2, groups // cols, 2, cols // 2)


def shuffle_mx_scales(s: torch.Tensor) -> torch.Tensor:
    """e8m0 scales `[E, N, G]` -> tiles of 32 rows x 8 groups, each tile ordered by
    (group % 4, row % 16, group quad, row half): the order AITER's a16w4 kernels read."""
    return s.reshape(_mx_scale_view(s.shape)).permute(0, 1, 4, 6, 3, 5, 2).contiguous().view(s.shape)


def unshuffle_mx_scales(s: torch.Tensor) -> torch.Tensor:
    """Inverse of `shuffle_mx_scales`."""
    e, n1, _, lanes, g1, _, quad = _mx_scale_view(s.shape)
    view = s.reshape(e, n1, g1, quad, lanes, 2, 2)
    return view.permute(0, 1, 6, 4, 2, 5, 3).contiguous().view(s.shape)


def _shuffle_mx(t: Tensors, spec: MoESpec, enabled: bool, inverse: bool) -> Tensors:
    """Shuffle mxfp4 scales; the group count is padded to whole tiles with 2^0 (e8m0 127)."""
    if not enabled:
        return t
    if spec.quant.weights != "mxfp4":
        raise SpecError(f"mx scale shuffle applies to mxfp4 weights, not {spec.quant}")
    out = dict(t)
    for name, k in (("w13", spec.hidden_size), ("w2", spec.intermediate_size)):
        groups = k // MXFP4_GROUP
        s = t[f"{name}_scale"]
        if inverse:
            out[f"{name}_scale"] = unshuffle_mx_scales(s)[..., :groups].contiguous()
        else:
            padded = -(-groups // MX_SCALE_TILE[1]) * MX_SCALE_TILE[1]
            out[f"{name}_scale"] = shuffle_mx_scales(_pad_rows(s, -1, padded, fill=E8M0_BIAS))
    return out


# mx_words: a word (int32) holds 8 e2m1 values of one row: those at K = 32c + 16h + 8q + 2t + p
# of word 4c + t of the row's K/8. The kernels make each word four bf16 pairs, pair j = q + 2h
# holding the values of half p in bf16 half p: e2m1's sign, two exponent bits and mantissa at
# bf16's bits MX_PAIR_BITS + 16p (the sign, the exponent's lowest two, the mantissa's top one).
# A bf16 whose lowest exponent bits hold e2m1's exponent is the value times 2^-126 (code 0.5
# lands on a subnormal), which one multiply by the e8m0 scale times 2^126 finishes. Bit i of
# pair j comes from the word rotated left by MX_WORD_ROTATE[j][i]: it is stored at
# (MX_PAIR_BITS[i] + 16p - MX_WORD_ROTATE[j][i]) mod 32. Pairs 0-2 are one rotation (pair 0
# none, pair 1 a plain shift) and one mask each, pair 3 two of each and an or: 9 operations a
# word. No four turns of a pair's bits tile a word, so one rotation a pair cannot be had.
MX_PAIR_BITS = (15, 8, 7, 6)  # e2m1's bits 3 (sign), 2 and 1 (exponent), 0 (mantissa), as bf16 bits
MX_WORD_ROTATE = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (6, 14, 6, 6))
MX_WORD_ROWS = 16  # rows whose 64-K chunks (8 words each) are stored together: 512 contiguous bytes
MX_WORD_K = 64
MX_WORD_MAX_SCALE = E8M0_BIAS + 1  # the decode's bf16 multiplier 2^(s - 1) holds s <= 128 (scales <= 2)
_MX_WORD_EXPERTS = 16  # experts recoded at a time (int64 temporaries)


def _mx_word_view(shape: torch.Size, name: str) -> tuple[int, ...]:
    e, n, words = shape
    if n % MX_WORD_ROWS or (words * 8) % MX_WORD_K:
        raise SpecError(f"mx_words needs rows % {MX_WORD_ROWS} == 0 and K % {MX_WORD_K} == 0; "
                        f"{name} has {n} rows and K {words * 8}")
    return (e, n // MX_WORD_ROWS, MX_WORD_ROWS, words * 8 // MX_WORD_K, MX_WORD_K // 8)


def _mx_word_places() -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(h, q, p, the word bits of e2m1 bits 3 .. 0) of every value of a 32-K chunk's word."""
    return [(h, q, p, tuple((bit + 16 * p - turn) % 32 for bit, turn in zip(MX_PAIR_BITS, MX_WORD_ROTATE[q + 2 * h],
                                                                          strict=True)))
            for h in range(2) for q in range(2) for p in range(2)]


def _codes_to_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes `[E, N, K]` (int64) -> words `[E, N, K/8]` (int32), rows in order."""
    e, n, k = codes.shape
    c = codes.view(e, n, k // 32, 2, 2, 4, 2)  # K = 32c + 16h + 8q + 2t + p
    word = torch.zeros(e, n, k // 32, 4, dtype=torch.int64, device=codes.device)
    for h, q, p, places in _mx_word_places():
        v = c[:, :, :, h, q, :, p]
        for i, place in enumerate(places):
            word |= ((v >> (3 - i)) & 1) << place
    return (word - (word >> 31 << 32)).to(torch.int32).view(e, n, k // 8)


def _words_to_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of _codes_to_words: int64 codes `[E, N, K]`."""
    e, n, count = words.shape
    w = words.to(torch.int64).view(e, n, count // 4, 4) & 0xFFFFFFFF
    codes = torch.zeros(e, n, count // 4, 2, 2, 4, 2, dtype=torch.int64, device=words.device)
    for h, q, p, places in _mx_word_places():
        for i, place in enumerate(places):
            codes[:, :, :, h, q, :, p] |= ((w >> place) & 1) << (3 - i)
    return codes.view(e, n, count * 8)


def mx_words(packed: torch.Tensor, name: str = "the weight") -> torch.Tensor:
    """Canonical mxfp4 `[E, N, K/2]` uint8 (low nibble even K) -> int32 `[E, N, K/8]` words (see
    MX_WORD_ROTATE), each 16 rows' 64-K chunks stored together: `[E, N/16, K/64, 16, 8]` in memory."""
    e, n, half = packed.shape
    view = _mx_word_view(torch.Size((e, n, half // 4)), name)
    out = torch.empty(e, n, half // 4, dtype=torch.int32, device=packed.device)
    for first in range(0, e, _MX_WORD_EXPERTS):
        part = packed[first:first + _MX_WORD_EXPERTS].to(torch.int64)
        codes = torch.stack([part & 0xF, part >> 4], dim=-1).flatten(-2)
        words = _codes_to_words(codes).view(-1, *view[1:])
        out[first:first + _MX_WORD_EXPERTS] = words.permute(0, 1, 3, 2, 4).reshape(-1, n, half // 4)
    return out


def mx_unwords(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `mx_words`."""
    e, n, count = words.shape
    view = _mx_word_view(words.shape, "the weight")
    out = torch.empty(e, n, count * 4, dtype=torch.uint8, device=words.device)
    for first in range(0, e, _MX_WORD_EXPERTS):
        part = words[first:first + _MX_WORD_EXPERTS]
        rows = part.reshape(-1, view[1], view[3], view[2], view[4]).permute(0, 1, 3, 2, 4).reshape(-1, n, count)
        codes = _words_to_codes(rows)
        out[first:first + _MX_WORD_EXPERTS] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return out


# mx_words' e8m0 scales keep their shape `[E, N, K/32]` and bytes, reordered so that each 16-row
# group's 64-K chunk (16 rows, 2 scale groups) is one 32-byte run whose 4-byte word i holds rows i
# and i + 8: byte 2h + g of word i is row i + 8h, group 2c + g of chunk c. A lane of the Gluon
# kernels, which decodes rows i and i + 8 (gluon_kernels.mx_words_layout), loads a 64-K step's
# four scales as one word.
def _mx_scale_word_view(shape: torch.Size) -> tuple[int, ...]:
    e, n, groups = shape
    return (e, n // MX_WORD_ROWS, 2, MX_WORD_ROWS // 2, groups // 2, 2)  # [E, N/16, h, i, c, g]


MX_SCALE_ORDER = (0, 1, 4, 3, 2, 5)  # [E, N/16, h, i, c, g] -> [E, N/16, c, i, h, g]


def mx_scale_words(scales: torch.Tensor) -> torch.Tensor:
    """Canonical e8m0 scales `[E, N, K/32]` of an mx_words weight -> the same bytes in the order
    above (same shape)."""
    return scales.view(_mx_scale_word_view(scales.shape)).permute(MX_SCALE_ORDER).reshape(scales.shape)


def mx_scale_unwords(scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `mx_scale_words`."""
    view = _mx_scale_word_view(scales.shape)
    stored = tuple(view[i] for i in MX_SCALE_ORDER)
    return scales.view(stored).permute([MX_SCALE_ORDER.index(i) for i in range(6)]).reshape(scales.shape)


# mx_units (gfx942): an int16 unit holds four e2m1 values of one row, those at K = 64c + 16i + j
# of unit 16c + j (i = 0..3): the exponent and mantissa of value i at bits 3i..3i+2, its sign at
# bit 12 + i. A kernel makes quarter i of a 64-K chunk fp16 by `((u << (9 - 3i)) & 0x0E00) |
# ((u << (3 - i)) & 0x8000)`: the value times 2^-14, exact (code 0.5 an fp16 subnormal), which a
# multiply by the scale times 2^14 as fp16, 2^(s - 113), finishes, exact for e8m0 104..128: no
# join or reshape after the decode, so it runs in the matrix instruction's operand layout.
MX_UNIT_K = 64
MX_UNIT_SCALES = (E8M0_BIAS - 23, E8M0_BIAS + 1)  # e8m0 the fp16 decode keeps exact: 2^-23..2^1


def mx_units(packed: torch.Tensor, name: str = "the weight") -> torch.Tensor:
    """Packed mxfp4 `[E, N, K/2]` (uint8, even K in the low nibble) -> int16 units `[E, N, K/4]`."""
    e, n, half = packed.shape
    if (2 * half) % MX_UNIT_K:
        raise SpecError(f"mx_units needs K % {MX_UNIT_K} == 0; {name} has K {2 * half}")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(e, n, 2 * half // MX_UNIT_K, 4, MX_UNIT_K // 4)
    codes = codes.to(torch.int32)
    units = torch.zeros(e, n, 2 * half // MX_UNIT_K, MX_UNIT_K // 4, dtype=torch.int32, device=packed.device)
    for i in range(4):
        units |= ((codes[:, :, :, i] & 7) << (3 * i)) | ((codes[:, :, :, i] >> 3) << (12 + i))
    return (units - (units >> 15 << 16)).to(torch.int16).view(e, n, half // 2)


def mx_ununits(units: torch.Tensor) -> torch.Tensor:
    """Inverse of `mx_units`."""
    e, n, count = units.shape
    u = units.to(torch.int32).view(e, n, count * 4 // MX_UNIT_K, 1, MX_UNIT_K // 4) & 0xFFFF
    i = torch.arange(4, device=units.device).view(1, 1, 1, 4, 1)
    codes = ((u >> (3 * i)) & 7) | (((u >> (12 + i)) & 1) << 3)  # [E, N, chunks, 4, 16]: K = 64c + 16i + j
    codes = codes.reshape(e, n, count * 4)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _mx_groups_nonzero(packed: torch.Tensor) -> torch.Tensor:
    """bool `[E, N, K/32]`: whether a scale group of packed mxfp4 `[E, N, K/2]` holds a value
    other than +-0 (the kernels clamp an all-zero group's scale into what they decode)."""
    e, n, half = packed.shape
    return ((packed & 0x77) != 0).view(e, n, half * 2 // MXFP4_GROUP, MXFP4_GROUP // 2).any(-1)


def refuse_e8m0_outside(scales: torch.Tensor, name: str, least: int, most: int, holder: str,
                        advice: str = "") -> None:
    """SpecError, naming the tensor and the value, where an e8m0 scale of `scales` lies outside
    `least`..`most`, what `holder` keeps exact."""
    span = f"2^{least - E8M0_BIAS} to " if least else "up to "
    for value, out in ((int(scales.min()), lambda v: v < least), (int(scales.max()), lambda v: v > most)):
        if out(value):
            raise SpecError(f"{name} holds e8m0 {value} (2^{value - E8M0_BIAS}); {holder} scales {span}"
                            f"2^{most - E8M0_BIAS}{advice}")


def _mx_recode(t: Tensors, spec: MoESpec, layout: Layout, inverse: bool) -> Tensors:
    """mxfp4 weights as `mx_words` (their scales as `mx_scale_words`) or, those layout.mx_units
    names, as `mx_units` (scales canonical); refused, naming the tensor, where a scale lies
    outside what the decode keeps exact."""
    if not (layout.mx_words or layout.mx_units):
        return t
    if spec.quant.weights != "mxfp4":
        raise SpecError(f"{'mx_words' if layout.mx_words else 'mx_units'} applies to mxfp4 weights, not {spec.quant}")
    out = dict(t)
    for name in ("w13", "w2"):
        scale = f"{name}_scale"
        if layout.mx_words and inverse:
            out[name], out[scale] = mx_unwords(t[name]), mx_scale_unwords(t[scale])
        elif layout.mx_words:
            refuse_e8m0_outside(t[scale], scale, 0, MX_WORD_MAX_SCALE, "the mx_words layout decodes",
                                ": use a backend that keeps canonical mxfp4")
            out[name], out[scale] = mx_words(t[name], name), mx_scale_words(t[scale])
        elif name in layout.mx_units and inverse:
            out[name] = mx_ununits(t[name])
        elif name in layout.mx_units:
            held = t[scale][_mx_groups_nonzero(t[name])]  # an all-zero group's scale changes nothing: clamped
            if held.numel():
                refuse_e8m0_outside(held, scale, *MX_UNIT_SCALES, "the mx_units layout decodes",
                                    ": use packed bytes (MOE_OVERLAY_TRITON_MX_LAYOUT=bytes)")
            out[name] = mx_units(t[name], name)
    return out


def _transpose(t: Tensors, enabled: bool) -> Tensors:
    if not enabled:
        return t
    return {**t, "w13": t["w13"].transpose(-2, -1).contiguous(), "w2": t["w2"].transpose(-2, -1).contiguous()}


def _steps(spec: MoESpec, layout: Layout) -> list[Callable[[Tensors, bool], Tensors]]:
    return [
        lambda t, inv: _convert_fp8(t, spec, layout.fp8_format or spec.quant.fp8_format, inv),
        lambda t, inv: _pad(t, spec, layout, inv),
        lambda t, inv: _reorder_gate_up(t, spec, layout.gate_up, inv),
        lambda t, inv: _shuffle(t, layout.shuffle, inv),
        lambda t, inv: _shuffle_mx(t, spec, layout.mx_scale_shuffle, inv),
        lambda t, inv: _mx_recode(t, spec, layout, inv),
        lambda t, inv: _transpose(t, layout.transposed),
    ]


def to_layout(tensors: Tensors, spec: MoESpec, layout: Layout) -> Tensors:
    """Canonical tensors -> `layout` (new tensors; inputs are not modified)."""
    for step in _steps(spec, layout):
        tensors = step(tensors, False)
    return tensors


def to_canonical(tensors: Tensors, spec: MoESpec, layout: Layout) -> Tensors:
    """Tensors in `layout` -> canonical (new tensors; inputs are not modified)."""
    for step in reversed(_steps(spec, layout)):
        tensors = step(tensors, True)
    return tensors


def require_layout(actual: Layout, needed: Layout, who: str) -> None:
    """Fail closed: a kernel never runs on weights in a layout it was not prepared for."""
    if actual != needed:
        raise LayoutMismatchError(
            f"{who} needs expert weights in layout {needed!r} but they are in {actual!r}; "
            "call prepare() for this backend (or restore() then prepare() after a reload)"
        )
