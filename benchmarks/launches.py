"""Launch counts of the ``ndl.compile`` steps of a case, printed under the table (issue 13:
kernels per step before and after elementwise fusion)."""

from __future__ import annotations

from .runner import Impl


def launch_notes(impls: dict[str, Impl]) -> list[str]:
    """One line per recorded ``ndl.compile`` step among ``impls``: what a replay launches."""
    from needle.compiled import CompiledStep

    lines = []
    for name, impl in impls.items():
        if not isinstance(impl.fn, CompiledStep):
            continue
        s = impl.fn.stats(*impl.inputs[0])
        if not s.get("recorded"):
            lines.append(f"{name}: not recorded ({s.get('reason')})")
            continue
        if not s["fused_kernels"]:
            fused = "; no fusion"
        elif s["generated_kernels"]:
            fused = (f"; {s['fused_kernels']} launches of {s['generated_kernels']} generated "
                     f"kernels stand for {s['fused_calls']} elementwise calls")
        else:  # the CPUs (fuse=True): the plan, run op by op
            fused = f"; {s['fused_kernels']} fused groups of {s['fused_calls']} calls"
        if s["graphs"]:
            work = f"{s['graph_kernels']} kernels in {s['graphs']} graph(s)"
        else:
            work = f"{s['replay_calls']} backend calls"
        lines.append(f"{name}: {work} + {s['optimizer_calls']} optimizer launches per step "
                     f"(eager: {s['eager_calls']} backend calls){fused}")
    return lines
