"""Whole-layer time with the shipped launch entries, tails 0 / 1 / 2 (device exploration)."""
import json, os, sys, time
import torch
import moe_overlay as mo
from moe_overlay.backends.problems import MODELS, ROUTINGS, random_calls, random_weights, floor_for
from moe_overlay.backends.triton_moe.configs import SHIPPED_DIR, USER_FILES_ENV, LayerShape
from moe_overlay.backends.triton_moe.timing import graph_replay_seconds

shipped = json.loads((SHIPPED_DIR / "NVIDIA_H200.json").read_text())["devices"]["NVIDIA H200"]
files = {}
for tails in (0, 1, 2):
    table = {k: {m: {**e, "tails": tails} for m, e in v.items()} for k, v in shipped.items()}
    path = f"/tmp/tails{tails}.json"
    with open(path, "w") as f:
        json.dump({"devices": {"NVIDIA H200": table}}, f)
    files[tails] = path
points = [(n, m) for n, m in (a.split(":") for a in sys.argv[1:])]
bw, rate = 4.26e12, 794e12
for name in dict.fromkeys(n for n, _ in points):
    spec = next(x.spec for x in MODELS if x.name == name)
    tensors = random_weights(spec, "cuda", seed=0)
    ref_t = {k: v.clone() for k, v in tensors.items()}
    prepared = mo.PreparedExperts(spec, tensors, mo.get_backend("triton"))
    prepared.prepare()
    for n, m in points:
        if n != name:
            continue
        m = int(m)
        calls = random_calls(m, spec, "cuda", ROUTINGS, seed=10)
        floor = sum(floor_for(spec, c[2], bw, rate).seconds for c in calls) / ROUTINGS
        ref = mo.get_backend("torch").run(spec, ref_t, *calls[0], None)
        line = f"{name:12s} M={m:5d} floor {floor*1e6:8.1f}"
        for tails, path in files.items():
            os.environ[USER_FILES_ENV] = path
            out = prepared.apply(*calls[0])
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t0 = time.time()
            s = graph_replay_seconds(lambda: [prepared.apply(*c) for c in calls]) / ROUTINGS
            line += f" | tails{tails} {s*1e6:8.1f} us {100*floor/s:5.1f}% err {err:.1e} ({time.time()-t0:.0f}s)"
        print(line, flush=True)
    del prepared, tensors, ref_t
    torch.cuda.empty_cache()
