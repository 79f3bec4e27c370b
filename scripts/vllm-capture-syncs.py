"""Count the host synchronisations and copies tracer's vLLM capture makes per forward pass.

    PYTHONPATH=TREE python scripts/vllm-capture-syncs.py [MODEL] [N]

Runs the prefix-cache pair (a miss, then a request of the cached prefix and the prompt) through
``tracer.engines.vllm.engine.execute_loaded`` in this process, with every call of the tensor
methods that copy or wait (``.cpu``, ``.to(cpu)``, ``.tolist``, ``.item``, ``.numpy``,
``index_select``, ``.clone``, ``torch.cat``, ``torch.stack``; seen by a ``TorchFunctionMode``) counted
when tracer's own code made it, split into calls made while vLLM's model ran (the hooks: per forward pass) and after it (the
assembly of the records). The tree on ``PYTHONPATH`` is the one measured, so the same command
counts any checkout (``before``: main; ``after``: this branch). On the CPU a ``.cpu()`` is no
copy, but it is where a GPU run waits for the device.
"""

from __future__ import annotations

import collections
import json
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

COUNTED = {"cpu", "tolist", "item", "numpy", "index_select", "clone", "to", "cat", "stack"}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    import tracer
    from tracer.engines.door import realise
    from tracer.engines.vllm import engine as ve
    from tracer.execute.points import discover_points
    from tracer.plan.build import build

    lm = tracer.load_model(model, dtype="bfloat16", device="cpu", progress=False)
    scen = realise(build("prefix-cache", n, engine="vllm"), "vllm")
    ids = [int(x) for x in torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0))]
    points = discover_points(lm.model, "layers")
    ve.execute_loaded(lm, ids, scen.plan_a, points, scen.window, meta={"scenario": scen.name})  # start vLLM, warm up

    counts: dict[str, collections.Counter] = {"hooks": collections.Counter(), "after": collections.Counter()}
    state = {"passes": 0}

    def begin(module, args, kwargs):
        state["passes"] += 1

    def phase(frame) -> str:
        """``hooks`` when called from inside a module call (a forward hook), else ``after``."""
        for _ in range(40):
            if frame is None:
                break
            if frame.f_code.co_filename.endswith("torch/nn/modules/module.py"):
                return "hooks"
            frame = frame.f_back
        return "after"

    class Count(TorchFunctionMode):
        """Counts the copying / waiting torch calls tracer's own code makes (the caller's frame)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name in COUNTED:
                frame = sys._getframe(1)
                mine = "/tracer/" in frame.f_code.co_filename
                if name == "to" and not (any(str(x) == "cpu" for x in args[1:]) or str(kwargs.get("device")) == "cpu"):
                    mine = False
                if mine:
                    counts[phase(frame)][name] += 1
            return func(*args, **kwargs)

    eng = ve.engine_for(lm, ve.settings_of(scen.plan_a, "one-step", {}))
    pre = eng.model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True)
    try:
        with Count():
            for plan in (scen.plan_a, scen.plan_b):
                ve.execute_loaded(lm, ids, plan, points, scen.window, meta={"scenario": scen.name})
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    finally:
        pre.remove()
    passes = state["passes"]
    out = {"model": model, "n": n, "forward_passes": passes, "points": len(points),
           "in_hooks_total": dict(counts["hooks"]), "in_hooks_per_pass": {k: v / passes for k, v in counts["hooks"].items()},
           "after_the_passes": dict(counts["after"])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
