"""Where Maverick M=1's time goes: kernels launched by one call, and graph times."""
import torch
import moe_overlay as mo
from moe_overlay.backends.problems import ROUTINGS, model, random_calls, random_weights
from moe_overlay.backends.triton_moe.timing import graph_replay_seconds

for name in ("Maverick", "DeepSeek-V3"):
    spec = model(name).spec
    prepared = mo.PreparedExperts(spec, random_weights(spec, "cuda", seed=0), mo.get_backend("triton"))
    prepared.prepare()
    calls = random_calls(1, spec, "cuda", ROUTINGS, seed=10)
    prepared.apply(*calls[0])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for c in calls:
            prepared.apply(*c)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    t = graph_replay_seconds(lambda: [prepared.apply(*c) for c in calls], replays=50) / ROUTINGS
    print(f"{name} bench-style: {t*1e6:.2f} us per call")
    for n in (1, 4, 16):
        t = graph_replay_seconds(lambda: [prepared.apply(*c) for c in calls * n], replays=50) / (ROUTINGS * n)
        print(f"{name} {ROUTINGS * n} calls per graph: {t*1e6:.2f} us per call")
    del prepared
tiny = torch.zeros(1, device="cuda")
for n in (8, 64):
    t = graph_replay_seconds(lambda: [tiny.add_(1) for _ in range(n)], replays=50) / n
    print(f"empty-ish kernel in a graph of {n}: {t*1e6:.2f} us each")
