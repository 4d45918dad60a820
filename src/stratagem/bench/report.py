"""The training bench's results: the table, the JSON document and the PNG plot.

The table has one row per combination that ran (with a ``compression`` column when the run compared
compressors): samples per second (``*`` marks the fastest), the
median step time split into compute (the model's forward and backward) and the rest (reading and
applying the variables: communication, waiting for the others, the optimizer update), the bytes a
global step moved over the network, the final loss, the test accuracy after the last step (where the
model has one: ``test acc``), and the seconds until the loss first reached the target (``-``: never,
within the run). Skipped, failed and timed-out combinations follow, each with
its reason.
"""

from __future__ import annotations

from typing import Sequence

from stratagem.bench.runner import Outcome
from stratagem.bench.units import human_bytes


def _fastest(outcomes: Sequence[Outcome]) -> Outcome | None:
    ran = [o for o in outcomes if o.status == "ok"]
    return max(ran, key=lambda o: o.figures["samples_per_s"]) if ran else None


def _first_to_target(outcomes: Sequence[Outcome]) -> Outcome | None:
    reached = [o for o in outcomes if o.status == "ok" and o.figures["time_to_target_s"] is not None]
    return min(reached, key=lambda o: o.figures["time_to_target_s"]) if reached else None


def print_table(outcomes: Sequence[Outcome], header: str, console, compression: bool = False) -> None:
    """Render the results on ``console`` (a ``rich.console.Console``); ``compression``: with a
    column naming each combination's compressor."""
    from rich.table import Table

    fastest, first = _fastest(outcomes), _first_to_target(outcomes)
    target = next((o.figures["target_loss"] for o in outcomes if o.status == "ok"), None)
    console.print(header, markup=False, highlight=False)
    table = Table(box=None, pad_edge=False)
    columns = [("strategy", "left"), ("transport", "left")] + ([("compression", "left")] if compression else [])
    accuracy = any(o.status == "ok" and o.figures.get("test_accuracy") is not None for o in outcomes)
    for name, justify in (*columns, ("samples/s", "right"),
                          ("step ms", "right"), ("compute", "right"), ("other", "right"),
                          ("bytes/step", "right"), ("final loss", "right"),
                          *([("test acc", "right")] if accuracy else []),
                          (f"to loss {target:.3g}" if target is not None else "to target", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for o in outcomes:
        if o.status != "ok":
            continue
        f = o.figures
        to_target = "-" if f["time_to_target_s"] is None else f"{f['time_to_target_s']:.2f} s"
        cells = [o.combination.strategy.label, o.combination.transport]
        if compression:
            cells.append(o.combination.compression or "none")
        table.add_row(*cells,
                      f"{f['samples_per_s']:,.0f}" + (" *" if o is fastest else "  "),
                      f"{f['step_ms']:.1f}", f"{f['compute_ms']:.1f}", f"{f['other_ms']:.1f}",
                      human_bytes(int(round(f["bytes_per_step"]))), f"{f['final_loss']:.4g}",
                      *([_percent(f.get("test_accuracy"))] if accuracy else []),
                      to_target + (" *" if o is first else "  "))
    console.print(table)
    if fastest is not None:
        console.print(f"* fastest: {fastest.combination.label}"
                      + (f"; first to the target loss: {first.combination.label}" if first else ""))
    skipped = [o for o in outcomes if o.status == "skipped"]
    if skipped:
        console.print(f"skipped ({len(skipped)}):")
        for line in _skipped_lines(skipped):
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    for status in ("failed", "timeout"):
        group = [o for o in outcomes if o.status == status]
        if group:
            console.print(f"{status} ({len(group)}):")
            for o in group:
                console.print(f"  {o.combination.label}: {o.reason}", markup=False, highlight=False, soft_wrap=True)
                for line in o.errors or o.output_tail[-4:]:
                    console.print(f"      {line}", markup=False, highlight=False, soft_wrap=True)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _skipped_lines(skipped: Sequence[Outcome]) -> list[str]:
    """One line per reason: ``a, b x local: why`` when the reason is one transport's (or
    ``parameter_server:async x zmq, grpc: why`` one strategy's), so a transport that cannot run here
    is one line, not one per strategy."""
    by_reason: dict[str, list] = {}
    for o in skipped:
        by_reason.setdefault(o.reason, []).append(o.combination)
    lines = []
    for reason, combos in by_reason.items():
        transports = list(dict.fromkeys(c.transport for c in combos))
        strategies = list(dict.fromkeys(c.strategy.label for c in combos))
        if len(transports) == 1:
            lines.append(f"{', '.join(strategies)} x {transports[0]}: {reason}")
        elif len(strategies) == 1:
            lines.append(f"{strategies[0]} x {', '.join(transports)}: {reason}")
        else:
            lines.extend(f"{c.label}: {reason}" for c in combos)
    return lines


def to_json(outcomes: Sequence[Outcome], config: dict, environment: dict) -> dict:
    """Every figure, the settings and the environment, JSON-ready."""
    fastest, first = _fastest(outcomes), _first_to_target(outcomes)
    return {
        "config": config,
        "environment": environment,
        "results": [o.as_dict() for o in outcomes],
        "fastest": fastest.combination.label if fastest else None,
        "first_to_target": first.combination.label if first else None,
    }


def plot(outcomes: Sequence[Outcome], path: str, title: str) -> None:
    """A PNG: throughput bars (left) and loss against time (right), one colour per combination."""
    import matplotlib

    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt

    ran = [o for o in outcomes if o.status == "ok"]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(14, max(4.5, 0.35 * len(ran) + 2)))
    colors = plt.get_cmap("tab20").colors
    labels = [o.combination.label for o in ran]
    bars.barh(range(len(ran)), [o.figures["samples_per_s"] for o in ran],
              color=[colors[i % len(colors)] for i in range(len(ran))])
    bars.set_yticks(range(len(ran)), labels)
    bars.invert_yaxis()
    bars.set_xlabel("samples / s")
    bars.set_title("throughput")
    for i, o in enumerate(ran):
        t, loss = zip(*o.figures["loss_curve"])
        curves.plot(t, loss, label=labels[i], color=colors[i % len(colors)])
    if ran:
        curves.axhline(ran[0].figures["target_loss"], color="grey", linestyle=":", label="target")
        losses = [loss for o in ran for _, loss in o.figures["loss_curve"] if loss > 0]
        if losses and max(losses) / min(losses) > 20:   # log only where the losses span decades
            curves.set_yscale("log")
        curves.legend(fontsize="small")
    curves.set_xlabel("seconds since the first step")
    curves.set_ylabel("training loss")
    curves.set_title("loss against time")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
