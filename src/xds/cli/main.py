"""``xds``: the command-line entry point.

Commands stay thin: each parses its arguments, calls the public API and prints. Bad arguments
give one clear line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from xds import __version__
from xds.errors import ConfigError, TraceError, XdsError
from xds.units import GB, S, fmt_bytes, fmt_ns

if TYPE_CHECKING:  # the CLI imports the simulator lazily, command by command
    from xds.serve.compare import Comparison


class _LazyConsole:
    """A rich console bound to the current stdout; when stdout is not a terminal, ``COLUMNS``
    columns if set (a whole number), else 120."""

    def print(self, *objects: object) -> None:
        width = None
        if not sys.stdout.isatty():
            columns = os.environ.get("COLUMNS", "")
            width = int(columns) if columns.isdigit() and int(columns) >= 40 else 120
        out = Console(file=sys.stdout, width=width)
        for obj in objects:
            if isinstance(obj, Table) and (obj.title or obj.caption):
                # a title or caption wraps to the table's width, splitting names mid-word:
                # printed on their own, they wrap to the terminal's, at spaces
                title, caption = obj.title, obj.caption
                obj.title = obj.caption = None
                if title:
                    out.print(title, style="bold")
                out.print(obj)
                if caption:
                    out.print(caption, style="dim")
                obj.title, obj.caption = title, caption
            else:
                out.print(obj)


console = _LazyConsole()

_seed_option = click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of every random stream of the run (all of its randomness comes from it).",
)
_backend_option = click.option(
    "--backend",
    type=click.Choice(["asyncio", "trio"]),
    default="asyncio",
    show_default=True,
    help="Event-loop backend: asyncio (xds's virtual loop) or trio (verification).",
)
_servers_option = click.option(
    "--servers",
    type=click.IntRange(min=1, max=48),
    default=48,
    show_default=True,
    help="Servers in the pod (48 in the real CloudMatrix384).",
)


_plot_option = click.option(
    "--plot",
    "plot_path",
    default=None,
    metavar="FILE.png|.svg|.pdf",
    help="Also draw the results into this file (needs matplotlib: pip install 'xds-sim[plot]').",
)


def _in_out_dir(path: str, option: str, out_dir: str | None) -> bool:
    """Whether ``path`` goes into the ``--out`` directory (which the run creates before it
    writes figures; a name of its own results there is refused: it would replace them)."""
    if out_dir is None or Path(path).resolve().parent != Path(out_dir).resolve():
        return False
    if Path(path).name in OUTPUT_FILES:
        raise click.UsageError(f"{option} {path}: --out writes {Path(path).name} there")
    return not Path(out_dir).exists()


def _check_output(path: str | None, option: str, out_dir: str | None, check) -> None:
    """Fail before a long run, not after it, if ``option``'s file cannot be written:
    ``check(path, folder_made_later)`` raises ConfigError (the folder may be the ``--out``
    directory, made before the file is written)."""
    if path is None:
        return
    later = _in_out_dir(path, option, out_dir)
    try:
        check(path, later)
    except ConfigError as exc:
        raise click.UsageError(f"{option} {path}: {exc.message}") from None


def _save_output(path: str | None, option: str, save, *, said: str, quiet: bool) -> None:
    """``save(path)`` once the results have been printed (a failure to save leaves them on
    screen, and is one line); then ``said`` unless ``quiet``."""
    if path is None:
        return
    try:
        save(path)
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise click.UsageError(f"{option} {path}: {why}") from None
    if not quiet:
        console.print(said)


def _check_plot(plot_path: str | None, out_dir: str | None = None) -> None:
    """``--plot`` can be drawn (matplotlib) and written."""
    from xds import plots

    def check(path: str, later: bool) -> None:
        plots.require_matplotlib()
        plots.check_path(path, folder_made_later=later)

    _check_output(plot_path, "--plot", out_dir, check)


def _save_plot(draw, plot_path: str | None, *, quiet: bool) -> None:
    """Draw (``draw()`` builds the figure) and save ``--plot`` after the results."""
    from xds import plots

    said = f"plotted to {escape(plot_path or '')}"
    _save_output(plot_path, "--plot", lambda p: plots.save(draw(), p), said=said, quiet=quiet)


_timeline_option = click.option(
    "--timeline",
    "timeline_path",
    default=None,
    metavar="FILE.json|.json.gz",
    help="Also write the replay's timeline (every request's phases, TE occupancy, faults) in "
    "the Trace Event Format: open it in ui.perfetto.dev or chrome://tracing.",
)


def _check_timeline(timeline_path: str | None, out_dir: str | None = None) -> None:
    """``--timeline`` can be written."""
    from xds.trace import timeline

    def check(path: str, later: bool) -> None:
        timeline.check_path(path, folder_made_later=later)

    _check_output(timeline_path, "--timeline", out_dir, check)


def _save_timeline(build, timeline_path: str | None, *, quiet: bool) -> None:
    """Build (``build()``) and write ``--timeline`` after the results."""
    from xds.trace import timeline

    said = f"timeline written to {escape(timeline_path or '')} (open it in ui.perfetto.dev)"
    _save_output(
        timeline_path, "--timeline", lambda p: timeline.save(build(), p), said=said, quiet=quiet
    )


POLICY_SLOTS = (
    "decode_routing",
    "prefill_placement",
    "prefill_te_selection",
    "decode_te_selection",
    "kv_mover",
)
"""What ``--policy SLOT=MODULE:FUNCTION`` plugs into a replay (the keywords of ``replay``)."""

_policy_option = click.option(
    "--policy",
    "policy_specs",
    multiple=True,
    metavar="SLOT=MODULE:FUNCTION",
    help="Plug in a function of yours: SLOT is one of " + ", ".join(POLICY_SLOTS) + "; MODULE "
    "a module importable from the current directory or a .py file. Repeatable.",
)


def _policies(specs: tuple[str, ...]) -> dict[str, Any]:
    """``--policy`` values as ``replay`` keywords, each function loaded from its module."""
    out: dict[str, Any] = {}
    for spec in specs:
        slot, eq, target = spec.partition("=")
        module_name, colon, function = target.rpartition(":")
        if not eq or not colon or not module_name or not function:
            raise click.UsageError(
                f"--policy {spec}: write SLOT=MODULE:FUNCTION, e.g. "
                "decode_routing=mypolicies:fewest_active"
            )
        if slot not in POLICY_SLOTS:
            raise click.UsageError(
                f"--policy {spec}: unknown slot {slot!r}; one of {', '.join(POLICY_SLOTS)}"
            )
        if slot in out:
            raise click.UsageError(f"--policy {spec}: {slot} is given twice")
        try:
            module = _import_plugin(module_name, option=f"--policy {slot}=")
        except click.UsageError as exc:  # name the whole spec, as the user wrote it
            said = exc.format_message().replace(f"--policy {slot}={module_name}", "", 1)
            raise click.UsageError(f"--policy {spec}{said}") from None
        fn = getattr(module, function, None)
        if fn is None:
            raise click.UsageError(f"--policy {spec}: {module_name} has no {function!r}")
        out[slot] = fn
    return out


class _OnceCommand(click.Command):
    """A command whose single-valued options are given at most once: ``--seed 1 --seed 2`` or
    ``--deployment A --deployment B`` is an error, where click would keep the last silently."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        options = {
            name: p
            for p in self.params
            if isinstance(p, click.Option)
            for name in (*p.opts, *p.secondary_opts)
        }
        seen: dict[str | None, str] = {}
        tokens = iter(args)
        for token in tokens:
            if token == "--":
                break
            name, eq, _ = token.partition("=")
            p = options.get(name if name.startswith("--") else token)
            if p is None:
                continue
            if not (p.is_flag or p.count or eq):
                for _ in range(p.nargs):  # its value, which may look like an option
                    next(tokens, None)
            if p.multiple or p.count:
                continue
            if p.name in seen:
                again = "given twice" if seen[p.name] == name else f"given with {seen[p.name]}"
                hint = (
                    "; `xds capacity` compares deployments"
                    if p.name == "deployment" and self.name == "replay"
                    else ""
                )
                raise click.UsageError(f"{name} is {again}: it takes one value{hint}")
            seen[p.name] = name
        return super().parse_args(ctx, args)


class _Group(click.Group):
    command_class = _OnceCommand


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=False,
)
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import a module (a name, or a path to a .py file) before the command runs, e.g. one "
    "that registers your EPLB policy with xds.serve.eplb.register_policy; repeatable.",
)
def app(imports: tuple[str, ...]) -> None:
    """xds: an emulator of xDeepServe on the CloudMatrix384 SuperPod, in virtual time."""
    for name in imports:
        _import_plugin(name)


_LOADED_FILES: dict[Any, Any] = {}
"""Modules :func:`_import_plugin` loaded from a .py path, by resolved path."""


def _loaded_from(path: Any) -> Any:
    """The module already loaded from the file ``path`` (by path or by name), or None."""
    resolved = path.resolve()
    hit = _LOADED_FILES.get(resolved)
    if hit is not None:
        return hit
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).name == resolved.name and Path(file).resolve() == resolved:
            return module
    return None


def _import_plugin(name: str, option: str = "--import") -> Any:
    """Import ``name`` and return the module: a module importable from the current directory,
    or a .py file (loaded under a private module name, so it never replaces a module of the
    same name). The current directory is on the import path only during the import. Errors
    are one usage line starting with ``option``."""
    import importlib
    import importlib.util
    import traceback
    from pathlib import Path

    option = option if option.endswith("=") else option + " "
    added = None
    module_name = name
    try:
        if name.endswith(".py"):
            path = Path(name)
            if not path.is_file():
                raise click.UsageError(f"{option}{name}: no such file")
            loaded = _loaded_from(path)
            if loaded is not None:  # imported already (by path or by name): once is enough
                return loaded
            module_name = f"_xds_import_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            _LOADED_FILES[path.resolve()] = module
            spec.loader.exec_module(module)
            return module
        else:
            cwd = str(Path.cwd())
            if cwd not in sys.path and "" not in sys.path:
                sys.path.append(cwd)
                added = cwd
            if name not in sys.modules:
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.origin and spec.has_location:
                    loaded = _loaded_from(Path(spec.origin))
                    if loaded is not None:  # the same file, given as a path before
                        sys.modules[name] = loaded
                        return loaded
            return importlib.import_module(name)
    except click.UsageError:
        raise
    except Exception as exc:  # the user's module failed: say where, in one line
        sys.modules.pop(module_name, None)
        for key in [k for k, m in _LOADED_FILES.items() if m.__name__ == module_name]:
            del _LOADED_FILES[key]
        if isinstance(exc, SyntaxError):
            raise click.UsageError(
                f"{option}{name}: SyntaxError: {exc.msg} ({Path(exc.filename or name).name}, "
                f"line {exc.lineno})"
            ) from None
        elif isinstance(exc, ModuleNotFoundError) and exc.name == name.split(".")[0]:
            raise click.UsageError(
                f"{option}{name}: no module named {exc.name!r} here (a module in the current "
                "directory, an installed one, or a path to a .py file)"
            ) from None
        else:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(frame.filename).name}, line {frame.lineno}"
        raise click.UsageError(f"{option}{name}: {type(exc).__name__}: {exc} ({where})") from None
    finally:
        if added is not None:
            sys.path.remove(added)


def _set_option(f=None, *, example: str = "--set prefill.tes=5 --set decode.model=kimi-k2"):
    """--set FIELD=VALUE, repeatable: settings laid over every deployment (``example``: fields
    of this command's deployments)."""

    def decorate(f):
        return click.option(
            "--set",
            "settings",
            multiple=True,
            metavar="FIELD=VALUE",
            help=f"Change a field of the deployment (of each, where several are given), e.g. "
            f"{example}: "
            "FIELD a dotted path, VALUE a TOML value or a bare word. Repeatable. One "
            "deployment's own: --deployment 'NAME@FIELD=VALUE@...'.",
        )(f)

    return decorate if f is None else decorate(f)


@app.command()
def version() -> None:
    """Print the xds version."""
    console.print(f"xds {__version__}")


@app.command()
@click.option("--json", "as_json", is_flag=True, help="Print the models as JSON.")
def models(as_json: bool) -> None:
    """List the models a deployment's ``model`` can name (with --import, yours too)."""
    import msgspec

    from xds.errors import ConfigError
    from xds.model import MODELS, check_attention

    rows = []
    for key, m in MODELS.items():
        try:
            check_attention(m)
            served = ""
        except ConfigError as exc:
            served = exc.message
        kv = m.kv_bytes_per_token(int8_nope=True)
        rows.append(
            {
                "model": key,
                "name": m.name,
                "attention": m.attention,
                "layers": m.layers,
                "dense_layers": m.dense_layers,
                "hidden": m.hidden,
                "routed_experts": m.routed_experts,
                "top_k": m.top_k,
                "shared_experts": m.shared_experts,
                "mtp_layers": m.mtp_layers,
                "max_context_tokens": m.max_context_tokens or None,
                "kv_bytes_per_token_int8": kv,
                "kv_bytes_per_token_bf16": m.kv_bytes_per_token(int8_nope=False),
                "total_params": None if served else m.total_params,
                "active_params": None if served else m.active_params,
                "not_served": served or None,
            }
        )
    if as_json:
        print(msgspec.json.encode(rows).decode())
        return
    table = Table(title="models (a deployment's model = ...)")
    columns = ("model", "attention", "layers", "experts", "MTP", "context", "KV B/token", "params")
    for col in columns:
        table.add_column(col, justify="left" if col in ("model", "attention") else "right")
    for r in rows:
        params = (
            f"{r['total_params'] / 1e9:,.0f}B / {r['active_params'] / 1e9:,.1f}B"
            if r["total_params"] is not None
            else "not served"
        )
        table.add_row(
            r["model"],
            r["attention"],
            f"{r['layers']} ({r['dense_layers']} dense)",
            f"{r['routed_experts']} top-{r['top_k']} + {r['shared_experts']}",
            str(r["mtp_layers"]),
            f"{r['max_context_tokens']:,}" if r["max_context_tokens"] else "-",
            f"{r['kv_bytes_per_token_int8']:,} / {r['kv_bytes_per_token_bf16']:,}",
            params,
        )
    table.caption = (
        "experts: routed, chosen per token, + shared; context: the longest sequence it "
        "serves (decode refuses longer); KV B/token over every cached layer, "
        "INT8 (the default precision) / BF16; params: total / active per token (MTP layers "
        "excluded)"
    )
    console.print(table)
    for r in rows:
        if r["not_served"]:
            console.print(f"{r['model']}: not served: {r['not_served']}")


def _pod(servers: int):
    from xds.hw import CloudMatrix384

    return CloudMatrix384(servers=servers)


@app.command()
@_servers_option
@click.option("--sources", is_flag=True, help="Also print every hardware number's source.")
def info(servers: int, sources: bool) -> None:
    """Print the pod: servers, chips, dies, AIVs, memory, compute and link bandwidths."""
    from xds.hw import DieSpec, EngineSpec, aiv_mte_bandwidth
    from xds.hw import sources as spec_sources

    pod = _pod(servers)
    s = pod.summary()
    c = pod.config
    d = c.die
    console.print(repr(pod))
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row(
        "servers x chips x dies", f"{c.servers} x {c.chips_per_server} x {c.dies_per_chip}"
    )
    table.add_row("chips / dies", f"{s['chips']} / {s['dies']}")
    table.add_row("AIC / AIV per die", f"{d.aic} / {d.aiv}")
    table.add_row("AIC / AIV in the pod", f"{s['aic']:,} / {s['aiv']:,}")
    table.add_row("Kunpeng CPUs", f"{s['kunpeng_cpus']}")
    table.add_row(
        "HBM per die / pod", f"{fmt_bytes(d.hbm_bytes)} / {s['hbm_bytes'] / 2**40:.1f} TiB"
    )
    table.add_row("HBM bandwidth per die", f"{d.hbm_bandwidth / 1e12:.2f} TB/s")
    table.add_row(
        "BF16 / INT8 peak per die",
        f"{d.bf16_flops / 1e12:.0f} TFLOPS / {d.int8_ops / 1e12:.0f} TOPS",
    )
    table.add_row("BF16 peak, pod", f"{s['bf16_flops'] / 1e15:.0f} PFLOPS")
    table.add_row("Unified Buffer per AIV", fmt_bytes(d.ubuf_bytes))
    for link in (c.ub, c.noc, c.roce, c.vpc):
        table.add_row(
            f"{link.name} link", f"{link.bandwidth / GB:.0f} GB/s, {fmt_ns(link.latency_ns)}"
        )
    e = c.engines
    table.add_row("XCCL launch / meta", f"{fmt_ns(e.kernel_launch_ns)} / {fmt_ns(e.meta_write_ns)}")
    table.add_row("MTE / DMA start-up", f"{fmt_ns(e.mte_startup_ns)} / {fmt_ns(e.dma_startup_ns)}")
    b_aiv = aiv_mte_bandwidth(e, d)
    table.add_row("MTE per AIV (b_aiv)", f"{b_aiv / GB:.1f} GB/s")
    console.print(table)
    if sources:
        src = Table(title="Sources", show_lines=False)
        src.add_column("parameter")
        src.add_column("source")
        for prefix, cls in (("die", DieSpec), ("engines", EngineSpec)):
            for name, text in spec_sources(cls).items():
                src.add_row(f"{prefix}.{name}", escape(text))
        for link in (c.ub, c.noc, c.roce, c.vpc, c.hccs):
            src.add_row(f"link.{link.name}", escape(link.source))
        src.caption = (
            "Grades: P primary (vendor file, paper), S secondary (a third-party summary), D "
            "derived by arithmetic, \\[emulator choice] where no public number exists. Tags: "
            "CANN = hicann/runtime platform ini files; CMI = Zuo et al., arXiv:2506.12708; "
            "CMI-S3 = a summary of the UB-Mesh and CloudMatrix384 papers; EM = emergentmind "
            "summary of CMI; BH = besthub article on CloudMatrix384; LLS = JiusiServe/"
            "light-llm-simulator hardware profile; XDS = arXiv:2508.02520 (the paper). Full "
            "references: REFERENCE.md."
        )
        console.print(src)


@app.command()
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Compute + barrier rounds.",
)
@_servers_option
@_seed_option
@_backend_option
def demo(steps: int, servers: int, seed: int, backend: str) -> None:
    """The built-in demo: pod summary and a timed virtual-time run with one task per die."""
    from xds.demo import run_demo

    pod = _pod(servers)
    console.print(f"[bold]{pod!r}[/bold]")
    s = pod.summary()
    console.print(
        f"{s['chips']} chips, {s['dies']} dies, {s['aiv']:,} AIVs, "
        f"{s['hbm_bytes'] / 2**40:.1f} TiB HBM, {s['bf16_flops'] / 1e15:.0f} PFLOPS BF16; "
        f"UB {pod.config.ub.bandwidth / GB:.0f} GB/s per die"
    )
    r = run_demo(pod, steps=steps, seed=seed, backend=backend)
    table = Table(
        title=f"{r.dies} die tasks x {r.steps} steps of jittered compute + barrier ({backend})"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("virtual time", fmt_ns(r.virtual_ns))
    table.add_row("per step (mean)", fmt_ns(round(r.step_mean_ns)))
    table.add_row(
        "barrier wait mean / max",
        f"{fmt_ns(round(r.barrier_wait_mean_ns))} / {fmt_ns(r.barrier_wait_max_ns)}",
    )
    table.add_row("timed events", f"{r.events:,}")
    table.add_row("wall time", f"{r.wall_s:.2f} s")
    table.add_row("events per wall second", f"{r.events / r.wall_s:,.0f}")
    table.add_row("event-log digest", r.digest[:16])
    console.print(table)


@app.command()
@click.argument("target", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print each result as one JSON object.")
@click.option(
    "--quick",
    is_flag=True,
    help="Shorter runs of peak-decode and production (smoke tests: smaller configurations "
    "than the paper's, so their rows are not expected to match).",
)
@click.option(
    "--strict", is_flag=True, help="Exit with code 1 if any row misses (not with --quick)."
)
def reproduce(target: str | None, as_json: bool, quick: bool, strict: bool) -> int:
    """Reproduce results of the paper: TARGET is p2p, dispatch-combine, a2e-e2a,
    peak-decode, ma-decode, eplb, production, or all.

    Prints the paper's number beside xds's for each row.
    """
    import json

    from xds.reproduce import QUICK, run_target, target_names

    if target is None:
        raise click.UsageError(
            f"name a TARGET: {', '.join(target_names())}, or all (e.g. `xds reproduce p2p`)"
        )
    if quick and strict:
        raise click.UsageError(
            "--strict judges the paper's configurations; --quick runs smaller ones"
        )
    if quick and target not in (*QUICK, "all"):
        raise click.UsageError(
            f"--quick applies to {', '.join(sorted(QUICK))} (and all); {target} has no shorter run"
        )
    names = target_names() if target == "all" else [target]
    missed: list[str] = []
    for name in names:
        result = run_target(name, quick=quick)
        missed += [f"{name} {row.name}" for row in result.rows if not row.ok]
        if as_json:
            print(json.dumps(result.to_json_object()))
            continue
        for data in result.tables:
            table = Table(title=data.title)
            for col in data.columns:
                table.add_column(col, justify="right")
            for row in data.rows:
                table.add_row(*row)
            console.print(table)
            for note in data.notes:
                console.print(note)
        smaller = quick and name in QUICK  # a smoke run: its rows are not the paper's setup
        what = " --quick: a smaller run, not judged" if smaller else ""
        rows = Table(title=f"xds reproduce {name}{what} ({result.wall_s:.1f} s wall)")
        for col in ("row", "paper", "xds", "unit", "relation", "ok"):
            rows.add_column(col, justify="right" if col in ("paper", "xds") else "left")
        for r in result.rows:
            rel = {"lt": "<", "gt": ">"}.get(r.relation, f"within {r.tolerance:.0%}")
            shown = r.shown or f"{r.xds:g}"
            verdict = "-" if smaller else "yes" if r.ok else "NO"
            rows.add_row(r.name, f"{r.paper:g}", shown, r.unit, rel, verdict)
        console.print(rows)
    if strict and missed:
        print(f"xds: --strict: {len(missed)} row(s) missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


@app.command()
@click.option(
    "--deployment",
    default="peak-decode",
    show_default=True,
    help="A preset name or a .toml/.json file of DecodeConfig fields (then @FIELD=VALUE ...).",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many iterations (default: run every request to the end).",
)
@click.option(
    "--tier",
    type=click.Choice(["iteration", "layer"]),
    default="iteration",
    show_default=True,
    help="Fidelity tier.",
)
@_seed_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_plot_option
@_set_option(example="--set batch_per_die=32 --set model=kimi-k2")
def decode(
    deployment: str,
    iterations: int | None,
    tier: str,
    seed: int,
    as_json: bool,
    plot_path: str | None = None,
    settings: tuple[str, ...] = (),
) -> None:
    """Run a colocated decode deployment and print its serving numbers."""
    import msgspec

    from xds.reproduce.peak_decode import measure
    from xds.serve.presets import PRESETS, decode_config, with_settings

    cfg = decode_config(deployment, settings)
    deployment = with_settings(deployment, settings, PRESETS)  # as the titles name it
    _check_plot(plot_path)
    res = measure(cfg, iterations=iterations, seed=seed, tier=tier)

    def draw():
        from xds.plots import decode_figure

        title = f"decode: {deployment} ({cfg.dies} dies, batch {cfg.batch_per_die}, seed {seed})"
        return decode_figure(res, title=title, attention=cfg.spec.attention)

    chips = cfg.dies / 2
    total = res.tokens / (res.elapsed_ns / 1e9)
    tpot_ms = res.mean_iteration_ns / 1e6 / res.mean_tokens_per_step
    if as_json:  # the result, and the headline figures the table derives from it
        headline = {
            "tpot_ms": tpot_ms,
            "tokens_per_s": total,
            "tokens_per_s_per_chip": total / chips,
        }
        print(msgspec.json.encode(msgspec.structs.asdict(res) | headline).decode())
        _save_plot(draw, plot_path, quiet=True)
        return
    table = Table(
        title=f"decode: {deployment} ({cfg.dies} dies, batch {cfg.batch_per_die}, {tier} tier)"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("iterations", f"{res.iterations:,}")
    table.add_row("mean iteration", f"{res.mean_iteration_ns / 1e6:.2f} ms")
    table.add_row("tokens per step", f"{res.mean_tokens_per_step:.3f}")
    table.add_row("TPOT", f"{tpot_ms:.2f} ms")
    table.add_row("tokens/s (total)", f"{total:,.0f}")
    table.add_row("tokens/s per chip", f"{total / chips:,.1f}")
    if cfg.eplb is not None:
        table.add_row("EPLB rebalances", f"{res.rebalances:,}")
    table.add_row("virtual time", fmt_ns(res.elapsed_ns))
    console.print(table)
    bd = res.breakdown
    kernels = Table(title="per-kernel time per iteration")
    kernels.add_column("kernel")
    kernels.add_column("ms", justify="right")
    kernels.add_column("share", justify="right")
    total_ns = max(bd.total(), 1)
    for name in bd.__struct_fields__:
        value = getattr(bd, name)
        label = "gqa_other" if name == "mla_other" and cfg.spec.attention == "gqa" else name
        kernels.add_row(label, f"{value / res.iterations / 1e6:.2f}", f"{value / total_ns:.1%}")
    kernels.caption = (
        f"shares of the kernels' time; the mean iteration adds the "
        f"{cfg.scheduler_gap_ns / 1e6:g} ms scheduler gap"
    )
    console.print(kernels)
    _save_plot(draw, plot_path, quiet=False)


@app.command("ma-decode")
@click.option(
    "--deployment",
    default="ma-peak-decode",
    show_default=True,
    help="A preset name or a .toml/.json file of MADecodeConfig fields (then @FIELD=VALUE ...).",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=2),
    default=6,
    show_default=True,
    help="Iterations per domain in the window (the first is not averaged).",
)
@click.option(
    "--from-token",
    type=click.IntRange(min=0),
    default=None,
    help="Start the window this many tokens into the output (default: half way).",
)
@click.option("--full", is_flag=True, help="Decode every sequence to the end instead.")
@_seed_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_set_option(example="--set domains=2 --set model=kimi-k2")
def ma_decode(
    deployment: str,
    iterations: int,
    from_token: int | None,
    full: bool,
    seed: int,
    as_json: bool,
    settings: tuple[str, ...] = (),
) -> None:
    """Run a MoE-attention disaggregated decode deployment (SPEC 10.3) and print its numbers."""
    import msgspec

    from xds.runtime import run
    from xds.serve.ma_decode import MADecodeInstance, ae_curve
    from xds.serve.presets import MA_PRESETS, ma_config, with_settings

    cfg = ma_config(deployment, settings)
    deployment = with_settings(deployment, settings, MA_PRESETS)  # as the title names it
    if full and from_token is not None:
        raise click.UsageError("--from-token sets a window; --full runs the whole decode")
    if full and _given("iterations"):
        raise click.UsageError("--iterations sets a window; --full runs the whole decode")
    start = 0 if full else cfg.output_tokens // 2 if from_token is None else from_token
    if start >= cfg.output_tokens:
        raise ConfigError(
            f"must be below the deployment's output_tokens ({cfg.output_tokens}), got {start}",
            field="from_token",
        )
    most = (1 + cfg.mtp_config.k) * iterations  # tokens the window may take, every draft accepted
    if not full and start + most > cfg.output_tokens:
        raise click.UsageError(
            f"{iterations} iterations from token {start} may run past the end of decode "
            f"(output_tokens {cfg.output_tokens}, up to {1 + cfg.mtp_config.k} tokens per "
            "iteration): "
            "lower --from-token or --iterations, or use --full"
        )
    curve = ae_curve(cfg, seed=seed)

    async def main():
        instance = MADecodeInstance(cfg, curve, seed=seed)
        return await instance.serve(max_iterations=None if full else iterations, from_token=start)

    res = run(main, seed=seed, event_log=False)
    if as_json:  # the result, and the headline figures the table derives from it
        headline = {
            "mean_iteration_ns": res.mean_iteration_ns,
            "mean_tokens_per_step": res.mean_tokens_per_step,
            "tpot_ns": res.tpot_ns,
            "tokens_per_s_per_chip": res.tokens_per_s_per_chip,
        }
        print(msgspec.json.encode(msgspec.structs.asdict(res) | headline).decode())
        return
    table = Table(
        title=f"ma-decode: {deployment} ({cfg.domains} x {cfg.attention_dies_per_domain} "
        f"attention dies, {cfg.expert_dies} expert dies, batch {cfg.batch_per_die}, "
        f"{cfg.domain_turns} turns)"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    window = (
        f"every token ({res.iterations} iterations)"
        if full
        else f"{res.iterations} iterations from token {start}"
    )
    table.add_row("window", window)
    table.add_row("mean iteration", f"{res.mean_iteration_ns / 1e6:.2f} ms")
    table.add_row("tokens per step", f"{res.mean_tokens_per_step:.3f}")
    table.add_row("TPOT", f"{res.tpot_ns / 1e6:.2f} ms")
    table.add_row("tokens/s per chip", f"{res.tokens_per_s_per_chip:,.1f}")
    table.add_row("tokens/s per attention die", f"{res.tokens_per_s / cfg.attention_dies:,.1f}")
    table.add_row("attention stage (layer, microbatch)", f"{res.mean_stage_ns / 1e3:.0f} us")
    table.add_row("MTP pass", f"{res.mean_mtp_pass_ns / 1e6:.2f} ms")
    table.add_row("MoE compute per batch", f"{res.mean_moe_ns / 1e3:.0f} us")
    for p in res.ae:
        table.add_row(
            f"A2E / E2A at {p.tokens_per_die} token{'s' * (p.tokens_per_die != 1)} per die",
            f"{p.a2e_ns / 1e3:.0f} / {p.e2a_ns / 1e3:.0f} us",
        )
    busy = res.stream_busy
    table.add_row(
        "expert kernels busy (A2E / MoE / E2A)",
        f"{busy['a2e']:.0%} / {busy['moe']:.0%} / {busy['e2a']:.0%}",
    )
    table.add_row("attention dies computing", f"{res.attention_busy:.0%}")
    table.add_row("virtual time", fmt_ns(res.elapsed_ns))
    console.print(table)


class _Finite(click.FloatRange):
    """A float range that is also finite: ``nan`` and ``inf`` are usage errors."""

    name = "finite float range"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return out


def _fault_option(recovered_as: str):
    """--fault (``replay``, ``compare``): a node fault is ``recovered_as`` says."""
    return click.option(
        "--fault",
        "fault_specs",
        multiple=True,
        metavar="KIND:KEY=VALUE,...",
        help="Inject a fault (times in seconds). Repeatable.\n\n\b\n"  # \b: kept as written
        "node:at=60,server=3[,repair=600]\n"
        f"  an NPU fault, recovered as {recovered_as} says\n"
        "link_down:at=10,prefill_te=0[,decode_te=0]\n  [,duration=5]: a silent stall\n"
        "transport:at=10,prefill_te=0[,decode_te=0]\n  transfers fail\n"
        "memory:at=10,dp=3[,decode_te=0]\n  [,first_block=0][,blocks=1]: Decode KV blocks "
        "masked",
    )


def _trace_options(f):
    """The options that say which workload to replay (shared by replay and capacity)."""
    for option in reversed(
        [
            click.argument("trace", required=False),
            click.option(
                "--format",
                "fmt",
                type=click.Choice(["mooncake", "azure", "request-csv", "lengths", "servegen"]),
                default=None,
                help="Trace format (default: guessed from the first line).",
            ),
            click.option(
                "--limit", type=click.IntRange(min=1), default=None, help="First N requests only."
            ),
            click.option(
                "--unique-prompts",
                is_flag=True,
                help="Built-in workload: no multi-turn conversations (no prompt shares a prefix).",
            ),
            click.option(
                "--columns",
                default="prompt_tokens,completion_tokens",
                show_default=True,
                help="--format lengths: the input and output length columns.",
            ),
            click.option(
                "--drop-invalid",
                is_flag=True,
                help="--format lengths: leave out rows whose lengths cannot be read (e.g. "
                "ShareGPT's empty turns) instead of failing on the first; the summary counts "
                "them (dropped_rows).",
            ),
            click.option(
                "--cv",
                type=_Finite(min=1e-3, max=1e3),
                default=1.0,
                show_default=True,
                help="--format lengths: inter-arrival coefficient of variation (1 = Poisson; "
                "0.001..1000).",
            ),
            click.option(
                "--span",
                default="0,600",
                show_default=True,
                help="ServeGen (TRACE a directory): START,SECONDS of its day to sample.",
            ),
            click.option(
                "--sort",
                is_flag=True,
                help="Sort the TRACE by arrival time (default: timestamps going backwards "
                "are an error).",
            ),
            click.option(
                "--spread-ties",
                is_flag=True,
                help="A TRACE with timestamps: spread the requests that share a timestamp "
                "uniformly over its step, up to the next timestamp (seeded by --seed). The "
                "Mooncake conversation trace's timestamps come in ~3 s steps, up to 28 "
                "requests each. Default: replayed as given, in bursts.",
            ),
            _seed_option,
        ]
    ):
        f = option(f)
    return f


def _replayed_workload_options(synthetic_note: str = ""):
    """--rate-scale, --synthetic and --rate: the workload ``replay`` and ``compare`` replay."""

    def add(f):
        for option in reversed(
            [
                click.option(
                    "--rate-scale",
                    type=_Finite(min=0, min_open=True),
                    default=1.0,
                    show_default=True,
                    help="Arrivals this many times as dense (2 halves every gap).",
                ),
                click.option(
                    "--synthetic",
                    "synthetic_n",
                    type=click.IntRange(min=1),
                    default=300,
                    show_default=True,
                    help="Without TRACE: requests of the built-in SPEC 12.4 workload"
                    + synthetic_note
                    + ".",
                ),
                click.option(
                    "--rate",
                    type=_Finite(min=0, min_open=True),
                    default=2.0,
                    show_default=True,
                    help="Arrival rate (req/s) of the built-in workload and of --format lengths.",
                ),
            ]
        ):
            f = option(f)
        return f

    return add


def _deployments_option(note: str):
    """--deployment, repeatable (``capacity`` and ``compare``)."""
    return click.option(
        "--deployment",
        "deployments",
        multiple=True,
        default=["production-4p1d"],
        show_default=True,
        help="A PD preset name or a .toml/.json file of PDConfig fields, then any "
        "@FIELD=VALUE settings of its own (production-4p1d@prefill.tes=5); repeat it to "
        f"compare deployments {note}.",
    )


def _sla_options(target: str, default: str = "'s SLA"):
    """--ttft-ms and --tpot-ms: the SLA's targets, overriding the deployment's."""

    def add(f):
        for name, value in (("--tpot-ms", "35 ms"), ("--ttft-ms", "2,000 ms")):
            f = click.option(
                name,
                type=_Finite(min=0, min_open=True),
                default=None,
                help=f"{name[2:6].upper()} target{target} [default: the deployment{default}, "
                f"{value}].",
            )(f)
        return f

    return add


def _jobs_option(what: str, same: str):
    """--jobs: worker processes (0: one per core, up to 4)."""
    return click.option(
        "--jobs",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help=f"Worker processes {what} (0: one per core, up to 4). {same} not depend on it.",
    )


def _progress_bar(label: str, field: str, *, quiet: bool):
    """A progress bar on stderr (none when ``quiet`` or stderr is not a terminal), gone when
    done; ``field`` is its text column (``{task.fields[...]}``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(field),
        disable=quiet or not sys.stderr.isatty(),
        transient=True,
    )


def _check_built_in_options(trace: str | None, fmt: str | None, unique_prompts: bool) -> None:
    """Usage errors for the built-in workload's options given with a TRACE."""
    if trace is None:
        return
    if unique_prompts:
        raise click.UsageError("--unique-prompts applies to the built-in workload, not a TRACE")
    if _given("synthetic_n"):
        raise click.UsageError("--synthetic applies to the built-in workload, not a TRACE")
    if _given("rate") and fmt != "lengths":
        raise click.UsageError("--rate applies to the built-in workload and --format lengths")


MIN_SEARCH_REQUESTS = 20
"""Requests a capacity search replays at least (its steady window is their middle half)."""


def _given(name: str) -> bool:
    """Whether the user passed option ``name`` (rather than getting its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not click.core.ParameterSource.DEFAULT


def _with_warm(result: Any) -> Any:
    """A capacity result as JSON builtins, each point with its ``warm`` flag (a property,
    which ``msgspec.to_builtins`` leaves out)."""
    import msgspec

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: walk(v) for k, v in value.items()}
            if "lead_in_s" in out and "mean_decode_s" in out:
                out["warm"] = out["lead_in_s"] >= out["mean_decode_s"]
            return out
        if isinstance(value, (list, tuple)):  # to_builtins keeps tuples (the points) tuples
            return [walk(v) for v in value]
        return value

    return walk(msgspec.to_builtins(result))


def _no_deployment_twice(deployments: Sequence[str]) -> None:
    """The same --deployment twice would run (and print) the same search twice: refused."""
    twice = next((d for i, d in enumerate(deployments) if d in deployments[:i]), None)
    if twice is not None:
        raise click.UsageError(f"--deployment {twice} is given twice")


def _check_trace_options(trace: str | None, fmt: str | None, sort: bool) -> None:
    """Usage errors for workload options that would otherwise be ignored silently."""
    if trace is None:
        for name, flag in (("fmt", "--format"), ("sort", "--sort"), ("span", "--span")):
            if _given(name):
                raise click.UsageError(f"{flag} applies to a TRACE")
    if fmt is None and trace is not None and Path(trace).is_dir():
        fmt = "servegen"  # as the loader takes a directory
    if _given("spread_ties") and (trace is None or fmt in ("lengths", "servegen")):
        raise click.UsageError(
            "--spread-ties applies to a TRACE with timestamps (not the built-in workload, "
            "--format lengths or ServeGen, whose arrivals xds draws)"
        )
    if fmt != "lengths":
        for name, flag in (
            ("columns", "--columns"),
            ("cv", "--cv"),
            ("drop_invalid", "--drop-invalid"),
        ):
            if _given(name):
                raise click.UsageError(f"{flag} applies to --format lengths")
    elif sort:
        raise click.UsageError("--sort applies to traces with timestamps, not --format lengths")


def _load_trace(
    trace: str,
    fmt: str | None,
    columns: str,
    rate: float,
    cv: float,
    seed: int,
    sort: bool,
    span: str = "0,600",
    drop_invalid: bool = False,
    limit: int | None = None,
    spread_ties: bool = False,
    *,
    quiet: bool = False,
):
    """A trace file as a Workload (``--format lengths`` gets arrivals at ``rate``, and leaves
    out unreadable rows with ``drop_invalid``; a ServeGen directory is sampled over
    ``span``). With ``limit`` a file is read only up to its ``limit``-th request (all of it
    with ``sort``, which needs every row)."""
    from pathlib import Path

    import numpy as np

    from xds.trace import load, load_lengths, load_servegen

    if fmt == "servegen" or (fmt is None and Path(trace).is_dir()):
        if sort:
            raise click.UsageError("--sort applies to traces with timestamps, not ServeGen")
        try:
            start, seconds = (float(v) for v in span.split(","))
        except ValueError:
            raise click.UsageError(f"--span takes START,SECONDS, got {span!r}") from None
        try:
            return load_servegen(trace, start_s=start, duration_s=seconds, seed=seed)
        except (ConfigError, TraceError) as exc:
            if "start_s" not in (exc.field or "") and "duration_s" not in (exc.field or ""):
                raise
            message = exc.message if isinstance(exc, ConfigError) else str(exc).split(": ", 1)[-1]
            raise click.UsageError(f"--span {span}: {message}") from None
    if _given("span"):
        raise click.UsageError("--span applies to a ServeGen directory")
    if fmt != "lengths":
        workload = load(trace, fmt, sort=sort, limit=limit)
        if spread_ties:
            from xds.runtime.rng import RngStreams

            spread = workload.spread_ties(RngStreams(seed)("trace/spread-ties"))
            if spread is workload and workload.tied() and not quiet:
                click.echo(
                    "xds: --spread-ties: every request arrives at the same timestamp, so there "
                    "is no step to spread them over: replayed as given",
                    err=True,
                )
            return spread
        if not quiet and (tied := workload.tied()) >= 10 and tied > len(workload) // 10:
            click.echo(
                f"xds: {tied:,} of {len(workload):,} requests arrive at the same time as the "
                "one before (quantised timestamps?): replayed as given, in bursts; "
                "--spread-ties spreads them over each timestamp's step",
                err=True,
            )
        return workload
    cols = [c.strip() for c in columns.split(",")]
    if len(cols) != 2 or not all(cols):
        raise click.UsageError("--columns takes two names: INPUT,OUTPUT")
    if cols[0] == cols[1]:
        raise click.UsageError(
            f"--columns names {cols[0]!r} for both input and output lengths: INPUT,OUTPUT"
        )
    return load_lengths(
        trace,
        input_column=cols[0],
        output_column=cols[1],
        rng=np.random.default_rng(seed),
        rate_per_s=rate,
        cv=cv,
        invalid="drop" if drop_invalid else "error",
        limit=limit,
    )


def _trace_by_seed(
    trace: str,
    fmt: str | None,
    columns: str,
    rate: float,
    cv: float,
    seed: int,
    sort: bool,
    span: str,
    drop_invalid: bool,
    limit: int | None,
    spread_ties: bool,
):
    """``seed -> the TRACE as a Workload`` (limited): loaded once, with its notes, for
    ``seed``; a trace whose arrivals xds draws (``--format lengths``, ServeGen,
    ``--spread-ties``) is drawn again, quietly, for another seed, any other is the same."""
    drawn = spread_ties or fmt in ("lengths", "servegen") or Path(trace).is_dir()
    loaded: dict[int, Any] = {}

    def at(s: int):
        key = s if drawn else seed
        if key not in loaded:
            w = _load_trace(
                trace,
                fmt,
                columns,
                rate,
                cv,
                key,
                sort,
                span,
                drop_invalid,
                limit,
                spread_ties,
                quiet=key != seed,
            )
            loaded[key] = w.limited(limit)
        return loaded[key]

    at(seed)  # a bad file fails now, before any replay
    return at


def _note_dropped(workload) -> None:
    """On stderr: the rows ``--drop-invalid`` left out among those read (the summary counts
    them too)."""
    if workload.dropped:
        why, n = workload.dropped[0][1], len(workload.dropped)
        click.echo(
            f"xds: --drop-invalid left out {n:,} row{'s' if n != 1 else ''} with unusable lengths "
            f"(first: {why})",
            err=True,
        )


def _trace_format(trace: str, fmt: str | None) -> str:
    """The format a TRACE was read as: given, or guessed as the loader did."""
    from xds.trace import guess_format

    return fmt or guess_format(trace)


OUTPUT_FILES = ("requests.jsonl", "requests.csv", "summary.json", "faults.json")
"""What ``xds replay --out`` writes; of these, the ones a run does not write are removed, so
the directory holds one run's results (other files are left alone)."""


def _check_out_dir(out_dir: str) -> None:
    """Fail before a long replay, not after it, if ``--out`` cannot be a directory we can
    write in; the directory is created only when the results are written."""
    import os
    import tempfile

    if not out_dir.strip():
        raise click.UsageError("--out takes a directory name, got an empty one")
    path = Path(out_dir)
    if path.exists():
        if not path.is_dir():
            raise click.UsageError(f"--out {out_dir}: exists and is not a directory")
        probe = path / ".xds-write-check"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or exc
            raise click.UsageError(f"--out {out_dir}: cannot write there ({why})") from None
        return
    base = path.absolute().parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise click.UsageError(f"--out {out_dir}: {base} is not a directory")
    try:  # a directory made and removed: permissions alone miss read-only and virtual file
        os.rmdir(tempfile.mkdtemp(prefix=".xds-write-check-", dir=base))  # systems (/proc)
    except OSError as exc:
        why = exc.strerror or exc
        raise click.UsageError(f"--out {out_dir}: cannot create it in {base} ({why})") from None


def _write_out(out_dir: str, records, summary, as_csv: bool, faults: dict | None) -> None:
    """The results of a finished replay into ``out_dir`` (created now): requests.jsonl,
    summary.json, requests.csv with --csv and faults.json with faults; whichever of
    :data:`OUTPUT_FILES` this run does not write is removed."""
    import msgspec

    from xds.trace import write

    path = Path(out_dir)
    written = {"requests.jsonl", "summary.json"}
    try:
        write(path, records, summary, csv=as_csv)
        if as_csv:
            written.add("requests.csv")
        if faults is not None:
            (path / "faults.json").write_bytes(msgspec.json.format(msgspec.json.encode(faults)))
            written.add("faults.json")
        for name in OUTPUT_FILES:
            if name not in written:
                (path / name).unlink(missing_ok=True)
    except OSError as exc:
        raise click.UsageError(f"--out {out_dir}: {exc.strerror or exc}") from None


def _cell(value: float) -> str:
    """A statistic for the replay table; "-" where there is none (e.g. ITL untracked)."""
    return "-" if math.isnan(value) else f"{value:,.2f}"


def _built_in(n: int, rate: float, seed: int, unique_prompts: bool, block_tokens: int):
    from xds.trace.production import (
        MOONCAKE_CONVERSATIONS,
        NO_CONVERSATIONS,
        production_workload,
    )

    conv = NO_CONVERSATIONS if unique_prompts else MOONCAKE_CONVERSATIONS
    return production_workload(
        n, rate_per_s=rate, seed=seed, conversations=conv, block_tokens=block_tokens
    )


@app.command()
@_trace_options
@click.option(
    "--deployment",
    default="production-4p1d",
    show_default=True,
    help="A PD preset name or a .toml/.json file of PDConfig fields (then @FIELD=VALUE ...).",
)
@_replayed_workload_options()
@click.option("--out", "out_dir", default=None, help="Write requests.jsonl and summary.json here.")
@click.option("--csv", "as_csv", is_flag=True, help="With --out, also write requests.csv.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_fault_option("--recovery")
@click.option(
    "--probe", is_flag=True, help="Probe every DistFlow pair's link (SPEC 11.1) during the replay."
)
@click.option(
    "--recovery",
    type=click.Choice(["restart_world", "independent", "scale_down"]),
    default=None,
    help="How node faults are recovered (default: the deployment's, restart_world); "
    "scale_down: independent failover where a Decode TE drops the failed server's dies.",
)
@click.option(
    "--serve-limit",
    "serve_limit_s",
    type=_Finite(min=0, max=365 * 86_400),
    default=86_400.0,
    show_default=True,
    help="Seconds of virtual time the replay keeps serving after the last arrival (or "
    "scheduled fault end); requests still in flight then fail with a reason.",
)
@_plot_option
@_timeline_option
@_policy_option
@_set_option
def replay(
    trace: str | None,
    fmt: str | None,
    deployment: str,
    rate_scale: float,
    limit: int | None,
    synthetic_n: int,
    rate: float,
    unique_prompts: bool,
    columns: str,
    cv: float,
    out_dir: str | None,
    as_csv: bool,
    span: str,
    sort: bool,
    seed: int,
    as_json: bool,
    drop_invalid: bool = False,
    spread_ties: bool = False,
    fault_specs: tuple[str, ...] = (),
    probe: bool = False,
    recovery: str | None = None,
    serve_limit_s: float = 86_400.0,
    plot_path: str | None = None,
    timeline_path: str | None = None,
    policy_specs: tuple[str, ...] = (),
    settings: tuple[str, ...] = (),
) -> None:
    """Replay a request trace (or the built-in workload) on a PD deployment."""
    import msgspec

    from xds.serve.presets import PD_PRESETS, pd_config, with_settings
    from xds.serve.recovery import RecoveryConfig
    from xds.serve.replay import check_distflow_faults
    from xds.serve.replay import replay as run_replay

    _check_trace_options(trace, fmt, sort)
    policies = _policies(policy_specs)
    _check_built_in_options(trace, fmt, unique_prompts)
    if as_csv and out_dir is None:
        raise click.UsageError("--csv writes requests.csv into the --out directory: give --out")
    if recovery is not None:  # a setting: the summary's name spells it
        own = pd_config(deployment, settings).recovery.mode
        if own != recovery and own != RecoveryConfig().mode:
            raise click.UsageError(
                f"--recovery {recovery} conflicts with recovery.mode={own} of the deployment "
                "(a file, an @ setting or --set): give one of them"
            )
        settings = (*settings, f"recovery.mode={recovery}")
    cfg = pd_config(deployment, settings)
    deployment = with_settings(deployment, settings, PD_PRESETS)  # as the summary names it
    if probe:
        from xds.serve.probe import ProbeConfig

        cfg = msgspec.structs.replace(cfg, probe=cfg.probe or ProbeConfig())
    faults = [_replay_fault(spec) for spec in fault_specs]
    _no_fault_twice(fault_specs, faults)
    if recovery is not None and not any(spec.startswith("node:") for spec in fault_specs):
        raise click.UsageError("--recovery applies to node faults: give a --fault node:...")
    with _names_fault_spec(fault_specs):
        check_distflow_faults(cfg, faults)
    if out_dir is not None:  # after the deployment: a bad file leaves no directory behind
        _check_out_dir(out_dir)
    _check_plot(plot_path, out_dir)
    _check_timeline(timeline_path, out_dir)
    if trace is None:
        workload = _built_in(
            synthetic_n, rate, seed, unique_prompts, cfg.prefill.prefix_block_tokens
        )
    else:
        workload = _load_trace(
            trace, fmt, columns, rate, cv, seed, sort, span, drop_invalid, limit, spread_ties
        )
    workload = workload.scaled(rate_scale).limited(limit)
    _note_dropped(workload)
    with _progress_bar("replay", "virtual {task.fields[t]}", quiet=as_json) as bar:
        task = bar.add_task("replay", total=len(workload), t="0 s")

        def progress(t_ns: int, done: int, total: int) -> None:
            bar.update(task, completed=done, t=fmt_ns(t_ns))

        with _names_deployment_file(deployment), _names_fault_spec(fault_specs):
            result = run_replay(
                workload,
                cfg,
                seed=seed,
                progress=progress,
                faults=faults,
                serve_grace_ns=round(serve_limit_s * S),
                **policies,
            )
    s = msgspec.structs.replace(
        result.summary,
        chips=result.chips,
        deployment=deployment,
        seed=seed,
        trace=trace,
        trace_format=None if trace is None else _trace_format(trace, fmt),
        workload=workload.source,
        dropped_rows=len(workload.dropped),
        faults=list(fault_specs),
        policies=list(policy_specs),
    )
    if out_dir is not None:
        outcome = None
        if faults or result.probes:  # what the faults did, for scripts
            outcome = {
                "restarts": result.restarts,
                "failovers": result.failovers,
                "kv_masks": result.kv_masks,
                "probes": result.probes,
                "unfired": result.unfired_faults,
            }
        _write_out(out_dir, result.records, s, as_csv, outcome)

    def draw():
        from xds.plots import replay_figure

        title = f"{workload.source} on {deployment} (seed {seed})"
        return replay_figure(result.records, sla=s.sla, title=title)

    def build_timeline():
        from xds.serve.timeline import replay_timeline

        title = f"{workload.source} on {deployment} (seed {seed})"
        return replay_timeline(result, title=title, faults=faults)

    for spec, fault in zip(fault_specs, faults, strict=True):
        if any(fault is u for u in result.unfired_faults):
            click.echo(
                f"xds: --fault {spec} never struck: every request had finished by "
                f"{fmt_ns(result.end_ns)}",
                err=True,
            )
    if as_json:
        print(msgspec.json.encode(s).decode())
        _save_plot(draw, plot_path, quiet=True)
        _save_timeline(build_timeline, timeline_path, quiet=True)
        return
    spares = f" + {cfg.spare_chips} spare" if cfg.spare_chips else ""
    table = Table(title=f"replay: {workload.source} on {deployment} ({result.chips} chips{spares})")
    table.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for name, stat, unit in (
        ("TTFT", s.ttft_ms, "ms"),
        ("TPOT", s.tpot_ms, "ms"),
        ("ITL", s.itl_ms, "ms"),
        ("E2E", s.e2e_s, "s"),
        ("prefill queueing", s.queue_ms, "ms"),
        ("decode admission wait", s.decode_wait_ms, "ms"),
        ("KV transfer", s.kv_transfer_ms, "ms"),
    ):
        table.add_row(
            f"{name} ({unit})", *(_cell(getattr(stat, q)) for q in ("mean", "p50", "p90", "p99"))
        )
    console.print(table)
    if not s.completed:
        console.print("no request completed: there is no latency to show (the failures below)")
    elif math.isnan(s.itl_ms.mean):
        if not any(r.outcome == "completed" and r.output_tokens > 1 for r in result.records):
            console.print(
                "ITL, TPOT, decode admission wait, KV transfer: no completed request has a "
                "second output token (each had one), so none was decoded"
            )
        elif cfg.record_token_times is False:
            console.print(
                "ITL: per-token times are off (record_token_times = false in the deployment)"
            )
        else:
            console.print(
                "ITL: per-token times are kept for workloads up to 5,000 requests "
                "(record_token_times = true in the deployment file keeps them)"
            )
    totals = Table(show_header=False)
    totals.add_row("requests", f"{s.requests:,} ({s.completed:,} completed, {s.failed:,} failed)")
    for reason, n in s.failures.items():
        totals.add_row("  failed", f"{n:,}: {escape(reason)}")
    per_chip = s.output_tokens_per_s_per_chip
    totals.add_row(
        "output tokens/s per chip", f"{per_chip:,.1f}" if per_chip >= 10 else f"{per_chip:.3g}"
    )
    totals.add_row(
        f"SLA goodput (TTFT < {s.sla.ttft_ms:g} ms, TPOT < {s.sla.tpot_ms:g} ms)",
        f"{s.goodput:.1%}",
    )
    totals.add_row("prefix-cache hits (share of prompt tokens)", f"{s.prefix_hit_ratio:.1%}")
    busy = ", ".join(f"{b:.0%}" for b in result.prefill_busy)
    totals.add_row("prefill TEs busy (first arrival to last first token)", busy)
    if s.decode is not None:
        d = s.decode
        totals.add_row(
            "decode iterations",
            f"{d.iterations:,}, {d.mean_iteration_ms:.1f} ms each, "
            f"{d.sequences_per_die:.{2 if d.sequences_per_die < 1 else 1}f} "
            f"sequences per die, busy {d.busy:.0%}",
        )
        totals.add_row(
            "decode context: busiest die / an even spread",
            "- (nothing decoded)"
            if math.isnan(d.context_max_over_ideal)
            else f"{d.context_max_over_ideal:.2f}x ({d.context_max_over_mean:.2f}x the mean die "
            "with sequences)",
        )
    last = "completion" if s.completed else "failure"
    totals.add_row(f"first arrival to last {last}", f"{s.duration_s:,.1f} s")
    last_done = max((r.finish_ns for r in result.records if r.outcome == "completed"), default=-1)
    if s.completed and result.end_ns > last_done:  # a failure ended later
        totals.add_row("last request ended (failed)", fmt_ns(result.end_ns))
    for r in result.restarts:
        never = "not before the replay ended"
        up = fmt_ns(r.prefill_up_ns) if r.prefill_up_ns >= 0 else never
        totals.add_row(
            "restart-the-world",
            f"at {fmt_ns(r.started_ns)}: {r.failed} in flight failed; Decode back "
            f"{fmt_ns(r.decode_up_ns) if r.decode_up_ns >= 0 else never}, Prefill back {up}"
            + (f" with {r.prefill_tes} TEs" if r.prefill_tes >= 0 else ""),
        )
    for fo in result.failovers:
        if fo.kind == "scale_up":
            totals.add_row(
                f"scale-up {fo.te}",
                f"server repaired {fmt_ns(fo.down_ns)}, serving on {fo.dies} dies again "
                f"{fmt_ns(fo.back_ns)}",
            )
            continue
        if fo.kind == "scale_down":
            back = (
                f"serving again {fmt_ns(fo.back_ns)} on {fo.dies} dies"
                if fo.back_ns >= 0
                else "not serving again before the replay ended"
            )
            totals.add_row(
                f"scale-down {fo.te}",
                f"at {fmt_ns(fo.down_ns)} ({fo.failed} failed), {back}",
            )
            continue
        back = (
            f"back {fmt_ns(fo.back_ns)} on servers {fo.servers}"
            if fo.back_ns >= 0
            else "stayed down"
        )
        totals.add_row(
            f"failover {fo.te}", f"down {fmt_ns(fo.down_ns)} ({fo.failed} failed), {back}"
        )
    for m in result.kv_masks:
        last = m.first_block + m.blocks - 1
        done = f"not masked: {m.skipped}" if m.skipped else f"masked ({m.failed} failed)"
        totals.add_row(
            f"memory fault {m.te}/DP{m.dp}",
            f"at {fmt_ns(m.at_ns)}: blocks {m.first_block}..{last} {done}",
        )
    if result.probes:
        counts: dict[str, int] = {}
        for pr in result.probes:
            counts[pr.verdict.value] = counts.get(pr.verdict.value, 0) + 1
        totals.add_row("link probes", ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    if out_dir is not None:
        totals.add_row("written to", escape(out_dir))
    console.print(totals)
    _save_plot(draw, plot_path, quiet=False)
    _save_timeline(build_timeline, timeline_path, quiet=False)


def _no_fault_twice(specs: tuple[str, ...], faults: Sequence[object], given: Sequence[object] = ()):
    """The same fault given twice (or already in the config file) would strike once: refused."""
    seen = list(given)
    for spec, fault in zip(specs, faults, strict=True):
        if fault in seen:
            raise click.UsageError(f"--fault {spec}: the same fault is given twice")
        seen.append(fault)


def _replay_fault(spec: str):
    """``--fault`` of ``xds replay``: KIND:KEY=VALUE,... with times in seconds."""
    from xds.config import split_spec

    keys = {
        "node": {"at", "server", "repair"},
        "link_down": {"at", "prefill_te", "decode_te", "duration"},
        "transport": {"at", "prefill_te", "decode_te"},
        "memory": {"at", "dp", "decode_te", "first_block", "blocks"},
    }
    kind, raw = split_spec(spec, keys)
    values: dict[str, float] = {}
    for key, value in raw.items():
        if key not in keys[kind]:
            raise click.UsageError(
                f"--fault {spec}: {key!r} is not one of {', '.join(sorted(keys[kind]))}"
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise click.UsageError(
                f"--fault {spec}: {key} must be a number, got {value!r}"
            ) from None
        limit = 1e6 if key in ("at", "repair", "duration") else 1e9  # seconds: about 11 days
        span = key in ("repair", "duration")  # 0 would mean never: from 1 ns
        if not math.isfinite(values[key]) or not 0 <= values[key] <= limit:
            low = "1e-09 (1 ns)" if span else "0"
            raise click.UsageError(
                f"--fault {spec}: {key} must be in {low}..{limit:g}, got {value!r}"
            )
        if key not in ("at", "repair", "duration") and not values[key].is_integer():
            raise click.UsageError(f"--fault {spec}: {key} must be a whole number, got {value!r}")
        if span and values[key] * 1e9 < 0.5:
            never = "a link that stays down" if key == "duration" else "a server never repaired"
            raise click.UsageError(
                f"--fault {spec}: {key} must be at least 1 ns, got {value!r} s (leave it out "
                f"for {never})"
            )
    needed = {"node": {"at", "server"}, "memory": {"at", "dp"}}.get(kind, {"at", "prefill_te"})
    if missing := needed - values.keys():
        raise click.UsageError(f"--fault {spec}: needs {', '.join(sorted(missing))}")

    def ns(key: str) -> int:
        return round(values.get(key, 0.0) * 1e9)

    try:
        return _replay_fault_of(kind, values, ns)
    except ConfigError as exc:
        raise click.UsageError(f"--fault {spec}: {_cli_key(exc.field)}: {exc.message}") from None


def _replay_fault_of(kind: str, values: dict[str, float], ns):
    """The replay fault of a checked ``--fault`` spec."""
    from xds.serve.recovery import MemoryFault, NodeFault
    from xds.serve.replay import DistFlowFault

    if kind == "node":
        return NodeFault(at_ns=ns("at"), server=int(values["server"]), repair_ns=ns("repair"))
    if kind == "memory":
        return MemoryFault(
            at_ns=ns("at"),
            dp=int(values["dp"]),
            decode_te=int(values.get("decode_te", 0)),
            first_block=int(values.get("first_block", 0)),
            blocks=int(values.get("blocks", 1)),
        )
    return DistFlowFault(
        at_ns=ns("at"),
        prefill_te=int(values["prefill_te"]),
        decode_te=int(values.get("decode_te", 0)),
        kind=kind,  # type: ignore[arg-type]
        duration_ns=ns("duration"),
    )


def _bounds(binding: str) -> str:
    """What a missed point missed, in a word per miss: "TPOT, TTFT", "goodput", "failures",
    "backlog"..."""

    def word(miss: str) -> str:
        if miss.startswith("mean "):
            return miss.split()[1]
        if "failed" in miss:
            return "failures"
        if "outpace" in miss:
            return "backlog"
        if miss.startswith("no request"):
            return "nothing completed"
        return miss.split()[0]

    return ", ".join(word(m) for m in binding.split("; ") if m)


def _found_cells(res, chips: int = 0) -> list[str]:
    """A table row's cells for the capacity a search found (with ``chips``, per chip too):
    the knob, arrivals/s, TPOT, TTFT and goodput there, and what bound the search."""
    p = res.found
    cells = [f"{p.scale:g}", f"{p.rate_per_s:,.2f}"]
    if chips:
        cells.append(f"{p.rate_per_s / chips:,.3f}")
    bound = "search cap" if res.capped else _bounds(res.binding)
    return [*cells, _ms(p.tpot_ms, 2), _ms(p.ttft_ms, 0), f"{p.goodput:.1%}", bound]


def _search_seeds(workload_at, cfg, seeds: list[int], show, quiet: bool, search: dict):
    """One capacity search per seed (``xds capacity --seeds``), each announced on stderr."""
    from xds.serve.capacity import SeededCapacity, search_capacity

    results = []
    for s in seeds:
        if not quiet:
            click.echo(f" seed {s}:", err=True)
        at = functools.partial(workload_at, block_tokens=cfg.prefill.prefix_block_tokens, s=s)
        results.append(search_capacity(at, cfg, seed=s, **search))
    return SeededCapacity.of(seeds, results)


def _print_seeded(
    name: str,
    chips: int,
    res,
    *,
    baseline=None,
    sla,
    what: str,
    unit: str,
    knob: str,
    as_json: bool,
    extra: dict | None = None,
    window_hint: str = "",
):
    """One deployment's searches over seeds: a line of JSON (with ``extra`` and, after the
    first deployment, the paired difference from ``baseline``), or a table and the interval."""
    import msgspec

    if as_json:
        line = {"deployment": name, "chips": chips, **_with_warm(res), **(extra or {})}
        if baseline is not None:
            line["difference_from_first"] = msgspec.to_builtins(res.difference(baseline))
        print(msgspec.json.encode(line).decode(), flush=True)
        return
    table = Table(
        title=f"capacity of {name} over seeds: {what} within TTFT {sla.ttft_ms:g} ms, "
        f"TPOT {sla.tpot_ms:g} ms"
    )
    for col in ("seed", knob, "arrivals/s", "mean TPOT ms", "mean TTFT ms", "goodput", "bound"):
        table.add_column(col, justify="left" if col == "bound" else "right")
    for s, r in zip(res.seeds, res.results, strict=True):
        if r.found is None:
            missed = "missed at the lowest rate: " + _bounds(r.binding)
            table.add_row(str(s), "-", "-", "-", "-", "-", missed)
        else:
            table.add_row(str(s), *_found_cells(r))
    console.print(table)
    c = res.capacity
    left_out = _left_out(res)
    if c.n == 0:
        console.print(f"capacity: none to average ({left_out})")
    else:
        console.print(
            f"capacity: {_spread_cell(c.mean, c.ci95, unit)} {unit} (mean over {c.n} of "
            f"{len(res.seeds)} seeds"
            + (", 95 % interval" if c.n > 1 else "")
            + f"; range {c.min:,g}..{c.max:,g})"
        )
        if left_out:
            console.print(f"note: left out {left_out}, so the mean is censored")
    _cold_note([p for r in res.results for p in r.points], unit, window_hint)


def _left_out(res) -> str:
    """The seeds a capacity over seeds leaves out, and why ("" if none)."""
    parts = []
    if res.capped:
        parts.append(
            f"{res.capped} seed(s) met the SLA up to the search cap, so their capacity is "
            "higher: raise --max-scale"
        )
    if res.missed:
        parts.append(
            f"{res.missed} seed(s) missed it at the lowest rate, so their capacity is lower: "
            "lower --min-scale"
        )
    return "; ".join(parts)


def _cold_note(points, unit: str, window_hint: str) -> None:
    """The note that points judged before decode filled up have an optimistic TPOT."""
    cold = [p for p in points if not p.warm]
    if not cold:
        return
    p = cold[0]
    scales = ", ".join(dict.fromkeys(f"{q.scale:g}" for q in cold))
    console.print(
        f"note: at {scales} {unit} the judged requests arrived less than a request's "
        f"mean decode time after the first (at {p.scale:g}: {p.lead_in_s:,.1f} s < "
        f"{p.mean_decode_s:,.1f} s): decode had not filled up, so TPOT there is "
        f"optimistic; give the search more arrivals ({window_hint})"
    )


def _print_seeded_compared(seeded: list, *, what: str, unit: str) -> None:
    """Several deployments' capacities over seeds, and each one's paired difference from the
    first (the same seed's searches subtracted)."""
    from xds.serve.capacity import found_value
    from xds.serve.compare import Spread

    table = Table(
        title=f"capacity compared over seeds: {what} within the SLA",
        caption="seeds: those averaged (one at the search cap or with none found is left "
        "out); Δ: the paired difference from the first, seed by seed",
    )
    for col in ("deployment", "chips", "seeds", f"capacity ({unit})", "req/s per chip", "Δ"):
        table.add_column(col, justify="left" if col == "deployment" else "right")
    base = seeded[0][2]
    for i, (name, chips, res) in enumerate(seeded):
        c = res.capacity
        per_chip = Spread.of([found_value(r, lambda p: p.rate_per_s) / chips for r in res.results])
        delta = "-"
        if i:
            d = res.difference(base)
            if not math.isnan(d.mean):
                verdict = ("higher" if d.mean > 0 else "lower") if d.excludes_zero else "~"
                if math.isnan(d.ci95):  # one seed in common: no interval
                    verdict = "-"
                delta = f"{_spread_cell(d.mean, d.ci95, unit, signed=True)} {verdict}"
        table.add_row(
            escape(name),
            str(chips),
            f"{c.n}/{len(res.seeds)}",
            _spread_cell(c.mean, c.ci95, unit),
            _spread_cell(per_chip.mean, per_chip.ci95, "per chip"),
            delta,
        )
    console.print(table)


def _ms(value: float, digits: int) -> str:
    """A millisecond figure for a table; "-" when there is none (nothing completed)."""
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


@app.command()
@_trace_options
@_deployments_option("on the same workload")
@click.option(
    "--window",
    "window_s",
    type=_Finite(min=0, min_open=True, max=86_400),
    default=600.0,
    show_default=True,
    help="Without TRACE: seconds of arrivals replayed at each rate (at most a day). It must "
    f"hold {MIN_SEARCH_REQUESTS} arrivals at --start; a lower rate the search tries replays "
    f"{MIN_SEARCH_REQUESTS} arrivals, over a longer span.",
)
@click.option(
    "--start",
    type=_Finite(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="First rate tried: req/s without TRACE, else a rate scale of the trace.",
)
@click.option(
    "--max-scale",
    type=_Finite(min=0, min_open=True),
    default=None,
    help="Highest rate (or scale) tried [default: 256 x start].",
)
@click.option(
    "--min-scale",
    type=_Finite(min=0, min_open=True),
    default=None,
    help="Lowest rate (or scale) tried [default: start / 256].",
)
@click.option(
    "--rate",
    type=_Finite(min=0, min_open=True),
    default=None,
    help="--format lengths: the arrival rate (req/s) at scale 1 [default: 2].",
)
@click.option(
    "--criterion",
    type=click.Choice(["mean", "goodput"]),  # xds.serve.capacity.CRITERIA (a test checks)
    default="mean",
    show_default=True,
    help="mean: mean TPOT and TTFT within the SLA; goodput: enough requests within it.",
)
@click.option(
    "--goodput",
    "goodput_target",
    type=_Finite(min=0, max=1, min_open=True),
    default=0.9,
    show_default=True,
    help="--criterion goodput: the share of requests that must meet the SLA.",
)
@_sla_options("")
@click.option(
    "--bisections",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Midpoints tried between the last rate that met the SLA and the first that missed.",
)
@_jobs_option("replaying the rates the search may try next", "The points tried and the result do")
@click.option(
    "--seeds",
    "n_seeds",
    type=click.IntRange(min=1, max=1000),
    default=1,
    show_default=True,
    help="Searches per deployment, seeds --seed, --seed + 1, ...: the capacity's mean with "
    "its 95 % interval (a search moves with its seed; two designs within a few per cent "
    "need it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_plot_option
@_policy_option
@_set_option
def capacity(
    trace: str | None,
    fmt: str | None,
    deployments: tuple[str, ...],
    limit: int | None,
    unique_prompts: bool,
    columns: str,
    cv: float,
    span: str,
    sort: bool,
    seed: int,
    window_s: float,
    start: float,
    max_scale: float | None,
    min_scale: float | None,
    rate: float | None,
    criterion: str,
    goodput_target: float,
    ttft_ms: float | None,
    tpot_ms: float | None,
    bisections: int,
    jobs: int,
    as_json: bool,
    n_seeds: int = 1,
    drop_invalid: bool = False,
    spread_ties: bool = False,
    plot_path: str | None = None,
    policy_specs: tuple[str, ...] = (),
    settings: tuple[str, ...] = (),
) -> None:
    """Find the highest arrival rate at which a PD deployment meets its SLA.

    Replays the workload at a sequence of rates (doubling or halving from --start, then
    bisecting) and judges each on the requests arriving in the middle half of its window.
    Without TRACE the built-in SPEC 12.4 workload is generated at each rate (--window seconds
    of arrivals; one seed gives the same requests at every rate, their gaps scaled); with a
    TRACE its arrivals are compressed or
    stretched (the rate scale is searched). Repeat --deployment to compare several on the
    same workload: a table of capacity per chip ends the output (--json: one line each)."""
    import msgspec

    from xds.serve.capacity import search_capacity
    from xds.serve.presets import PD_PRESETS, pd_config, with_settings
    from xds.serve.speculative import default_jobs
    from xds.trace.metrics import SLA

    _check_trace_options(trace, fmt, sort)
    if trace is not None and unique_prompts:
        raise click.UsageError("--unique-prompts applies to the built-in workload, not a TRACE")
    if trace is not None and _given("window_s"):
        raise click.UsageError("--window applies to the built-in workload; a TRACE brings its own")
    if rate is not None and fmt != "lengths":
        raise click.UsageError("--rate applies to --format lengths (the search sets the rate)")
    if trace is None and limit is not None:
        raise click.UsageError(
            "--limit applies to a TRACE; the built-in workload replays --window seconds of "
            "arrivals at each rate"
        )
    if criterion != "goodput" and _given("goodput_target"):
        raise click.UsageError("--goodput applies to --criterion goodput")
    _no_deployment_twice(deployments)
    # bad files fail up front; the output names each deployment with the settings it ran
    configs = [
        (with_settings(d, settings, PD_PRESETS), pd_config(d, settings)) for d in deployments
    ]
    deployments = tuple(name for name, _ in configs)
    policies = _policies(policy_specs)
    _check_plot(plot_path)
    if plot_path is not None and n_seeds > 1:
        raise click.UsageError("--plot draws one search per deployment: give --seeds 1")
    if trace is None:
        unit, knob = "req/s", "rate (req/s)"
        if not unique_prompts:  # the conversation history a rate needs is capped
            from xds.trace.production import MOONCAKE_CONVERSATIONS

            limit_rate = MOONCAKE_CONVERSATIONS.max_rate_per_s
            if start > limit_rate:
                raise click.UsageError(
                    f"--start {start:g}: the built-in workload's conversations reach at most "
                    f"{limit_rate:,.0f} req/s (--unique-prompts lifts it)"
                )
            max_scale = min(max_scale or 256 * start, limit_rate)

        if round(start * window_s) < MIN_SEARCH_REQUESTS:  # the search would judge a burst
            raise click.UsageError(
                f"--window {window_s:g}: at --start {start:g} req/s it holds "
                f"{round(start * window_s)} arrival(s); a search needs at least "
                f"{MIN_SEARCH_REQUESTS} (a window of at least {MIN_SEARCH_REQUESTS / start:g} s)"
            )

        def workload_at(x: float, block_tokens: int, s: int = seed):  # hashed as it caches
            n = max(MIN_SEARCH_REQUESTS, round(x * window_s))
            return _built_in(n, x, s, unique_prompts, block_tokens)
    else:
        unit, knob = "x trace rate", "rate scale"
        base_at = _trace_by_seed(
            trace, fmt, columns, rate or 2.0, cv, seed, sort, span, drop_invalid, limit, spread_ties
        )
        base = base_at(seed)
        _note_dropped(base)
        if len(base) < MIN_SEARCH_REQUESTS or not base.duration_ns:
            raise click.UsageError(
                f"{trace}: {len(base)} request(s)"
                + (" after --limit" if limit is not None else "")
                + (" arriving at once" if len(base) > 1 and not base.duration_ns else "")
                + f"; a capacity search judges the middle half of a trace's arrivals and needs "
                f"at least {MIN_SEARCH_REQUESTS} spread over time"
            )

        def workload_at(x: float, block_tokens: int, s: int = seed):  # its hashes are its own
            scaled = base_at(s).scaled(x)
            if not scaled.duration_ns:
                flag = "max_scale" if x > start else "min_scale" if x == min_scale else "start"
                raise ConfigError(
                    f"at {x:g}x its rate the trace's arrivals fall in one nanosecond",
                    field=flag,
                )
            return scaled

    def show(p) -> None:
        if not as_json:
            verdict = "meets" if p.meets else "misses: " + "; ".join(p.misses)
            click.echo(
                f"  {p.scale:g} {unit} ({p.rate_per_s:,.2f} req/s): TPOT {_ms(p.tpot_ms, 2)} "
                f"ms, TTFT {_ms(p.ttft_ms, 0)} ms, goodput {p.goodput:.1%}: {verdict}",
                err=True,
            )

    what = "mean TPOT and mean TTFT" if criterion == "mean" else f"{goodput_target:.0%} of requests"
    if trace is None:
        window_hint = "--window"
    elif fmt == "servegen" or (fmt is None and Path(trace).is_dir()):
        window_hint = "a longer --span"
    else:
        window_hint = "a longer trace"
    found = []
    seeded: list[tuple[str, int, Any]] = []
    searched = {  # what --json lines record of the search, beside each deployment's config
        "trace": trace,
        "trace_format": None if trace is None else _trace_format(trace, fmt),
        "workload": base.source
        if trace is not None
        else f"production(rate searched, {window_s:g} s of arrivals at each, "
        + ("unique prompts)" if unique_prompts else "conversations)"),
        "seed": seed,
        "scale_unit": unit,
    }
    if drop_invalid:
        searched["dropped_rows"] = len(base.dropped)
    for name, cfg in configs:
        sla = SLA(
            ttft_ms=cfg.sla.ttft_ms if ttft_ms is None else ttft_ms,
            tpot_ms=cfg.sla.tpot_ms if tpot_ms is None else tpot_ms,
        )
        cfg = msgspec.structs.replace(cfg, sla=sla)
        if not as_json and len(configs) > 1:
            click.echo(f"{name}:", err=True)
        if n_seeds > 1:
            seeded.append(
                (
                    name,
                    cfg.chips,
                    _search_seeds(
                        workload_at,
                        cfg,
                        list(range(seed, seed + n_seeds)),
                        show,
                        as_json,
                        dict(
                            start=start,
                            max_scale=max_scale,
                            min_scale=min_scale,
                            bisections=bisections,
                            criterion=criterion,
                            goodput_target=goodput_target,
                            on_point=show,
                            jobs=jobs or default_jobs(),
                            **policies,
                        ),
                    ),
                )
            )
            _print_seeded(
                *seeded[-1],
                baseline=seeded[0][2] if len(seeded) > 1 else None,
                sla=sla,
                what=what,
                unit=unit,
                knob=knob,
                as_json=as_json,
                extra={**searched, "config": msgspec.to_builtins(cfg)},
                window_hint=window_hint,
            )
            continue
        res = search_capacity(
            functools.partial(workload_at, block_tokens=cfg.prefill.prefix_block_tokens),
            cfg,
            start=start,
            max_scale=max_scale,
            min_scale=min_scale,
            bisections=bisections,
            criterion=criterion,  # type: ignore[arg-type]
            goodput_target=goodput_target,
            seed=seed,
            on_point=show,
            jobs=jobs or default_jobs(),
            **policies,
        )
        found.append((name, cfg.chips, res))
        if as_json:
            line = {
                "deployment": name,
                "chips": cfg.chips,
                **_with_warm(res),
                **searched,
                "config": msgspec.to_builtins(cfg),
            }
            print(msgspec.json.encode(line).decode(), flush=True)
            continue
        table = Table(
            title=f"capacity of {name}: {what} within TTFT {sla.ttft_ms:g} ms, "
            f"TPOT {sla.tpot_ms:g} ms"
        )
        for col in (
            knob,
            "arrivals/s",
            "mean TPOT ms",
            "mean TTFT ms",
            "goodput",
            "decode seqs/die",
            "prefill busy",
            "meets",
        ):
            table.add_column(col, justify="right")
        for p in res.points:
            table.add_row(
                f"{p.scale:g}",
                f"{p.rate_per_s:,.2f}",
                _ms(p.tpot_ms, 2),
                _ms(p.ttft_ms, 0),
                f"{p.goodput:.1%}",
                f"{p.decode_seqs_per_die:.1f}",
                f"{p.prefill_busy:.0%}",
                "yes" if p.meets else "no",
            )
        console.print(table)
        if res.found is None:
            console.print(f"no rate met the SLA; the lowest tried missed: {escape(res.binding)}")
        elif res.capped:
            console.print(f"every rate up to {res.found.scale:g} {unit} met the SLA (search cap)")
        else:
            console.print(
                f"capacity: {res.found.scale:g} {unit} ({res.found.rate_per_s:,.2f} req/s); "
                f"the next rate up missed: {escape(res.binding)}"
            )
        _cold_note(res.points, unit, window_hint)

    if seeded:
        if len(seeded) > 1 and not as_json:
            _print_seeded_compared(seeded, what=what, unit=unit)
        return

    def draw():
        from xds.plots import capacity_figure

        named: dict[str, Any] = {}
        for name, _, res in found:
            named[name] = res
        title = f"capacity search: {what} within the SLA (seed {seed})"
        return capacity_figure(named, title=title, knob=knob)

    if as_json or len(found) < 2:
        _save_plot(draw, plot_path, quiet=as_json)
        return
    compare = Table(title=f"capacity compared: {what} within the SLA")
    for col in (
        "deployment",
        "chips",
        knob,
        "req/s",
        "req/s per chip",
        "mean TPOT ms",
        "mean TTFT ms",
        "goodput",
        "bound",
    ):
        compare.add_column(  # a deployment's name folds rather than ending in "..."
            col,
            justify="left" if col[0] in "db" else "right",
            no_wrap=col != "deployment",
            overflow="fold" if col == "deployment" else "ellipsis",
        )
    for name, chips, res in found:
        p = res.found
        if p is None:
            compare.add_row(
                escape(name),
                str(chips),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "missed at the lowest rate: " + _bounds(res.binding),
            )
            continue
        compare.add_row(escape(name), str(chips), *_found_cells(res, chips))
    console.print(compare)
    _save_plot(draw, plot_path, quiet=False)


@app.command()
@_trace_options
@_deployments_option("(the first is the baseline)")
@click.option(
    "--seeds",
    "n_seeds",
    type=click.IntRange(min=1, max=1000),
    default=5,
    show_default=True,
    help="Replays per variant: seeds --seed, --seed + 1, ... (each seed gives every variant "
    "the same requests and random streams).",
)
@_replayed_workload_options(" (each seed its own)")
@_jobs_option("replaying in parallel", "The numbers do")
@_sla_options(" of goodput for every variant", "s' SLA, which must agree")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@_fault_option("each deployment's [recovery] mode")
@_policy_option
@_set_option
def compare(
    trace: str | None,
    fmt: str | None,
    deployments: tuple[str, ...],
    n_seeds: int,
    rate_scale: float,
    limit: int | None,
    synthetic_n: int,
    rate: float,
    unique_prompts: bool,
    columns: str,
    cv: float,
    span: str,
    sort: bool,
    seed: int,
    jobs: int,
    ttft_ms: float | None,
    tpot_ms: float | None,
    as_json: bool,
    drop_invalid: bool = False,
    spread_ties: bool = False,
    fault_specs: tuple[str, ...] = (),
    policy_specs: tuple[str, ...] = (),
    settings: tuple[str, ...] = (),
) -> None:
    """Compare deployments or policies on one workload over several seeds.

    Replays the workload on every variant once per seed and prints, per metric, each
    variant's mean with its 95 % confidence interval, and each later variant's paired
    difference from the first (the same seed's replays subtracted, then averaged): a
    difference whose interval excludes zero is marked better or worse, else "~" (within the
    seeds' noise). Variants: each --deployment, plus, with --policy, the first deployment with
    those policies plugged in."""
    import msgspec

    from xds.serve.compare import Variant
    from xds.serve.compare import compare as run_compare
    from xds.serve.presets import PD_PRESETS, pd_config, with_settings
    from xds.serve.speculative import default_jobs

    _check_trace_options(trace, fmt, sort)
    _check_built_in_options(trace, fmt, unique_prompts)
    _no_deployment_twice(deployments)
    variants: dict[str, Any] = {  # named with the settings each runs
        with_settings(d, settings, PD_PRESETS): pd_config(d, settings) for d in deployments
    }
    deployments = tuple(variants)
    policies = _policies(policy_specs)
    if policies:  # named as the user wrote them
        plugged = ", ".join(policy_specs)
        variants[f"{deployments[0]} + {plugged}"] = Variant(variants[deployments[0]], policies)
    sla = None
    if ttft_ms is not None or tpot_ms is not None:  # one SLA for every variant
        from xds.trace.metrics import SLA

        own = variants[deployments[0]].sla
        sla = SLA(
            ttft_ms=own.ttft_ms if ttft_ms is None else ttft_ms,
            tpot_ms=own.tpot_ms if tpot_ms is None else tpot_ms,
        )
    elif len({variants[d].sla for d in deployments}) > 1:
        judged = "; ".join(
            f"{d}: TTFT {variants[d].sla.ttft_ms:g} ms, TPOT {variants[d].sla.tpot_ms:g} ms"
            for d in deployments
        )
        raise click.UsageError(
            f"the deployments judge goodput by different SLAs ({judged}): give --ttft-ms and "
            "--tpot-ms to judge every variant by the same"
        )
    faults = [_replay_fault(spec) for spec in fault_specs]
    _no_fault_twice(fault_specs, faults)
    seeds = list(range(seed, seed + n_seeds))
    if trace is None:
        blocks = {variants[d].prefill.prefix_block_tokens for d in deployments}
        if len(blocks) > 1:
            raise click.UsageError(
                "the deployments hash prompts into prefix blocks of different sizes ("
                + ", ".join(str(b) for b in sorted(blocks))
                + " tokens): the built-in workload can only be shared by deployments with "
                "one prefill.prefix_block_tokens"
            )
        block = blocks.pop()

        def workload_for(s: int):
            built = _built_in(synthetic_n, rate, s, unique_prompts, block)
            return built.scaled(rate_scale).limited(limit)
    else:
        trace_at = _trace_by_seed(
            trace, fmt, columns, rate, cv, seed, sort, span, drop_invalid, limit, spread_ties
        )
        _note_dropped(trace_at(seed))  # a bad file fails before any replay

        def workload_for(s: int):
            return trace_at(s).scaled(rate_scale)

    total = len(variants) * len(seeds)
    with _progress_bar("compare", "{task.fields[last]}", quiet=as_json) as bar:
        task = bar.add_task("compare", total=total, last="")

        def progress(name: str, s: int, summary) -> None:
            bar.update(task, advance=1, last=f"{name}, seed {s}")

        with _names_variant_file(deployments), _names_fault_spec(fault_specs):
            result = run_compare(
                workload_for,
                variants,
                seeds=seeds,
                sla=sla,
                jobs=jobs or default_jobs(),
                on_replay=progress,
                faults=faults,
            )
    missed = [
        (v.name, s, n)
        for v in result.variants
        for s, n in zip(seeds, v.unfired_faults, strict=True)
    ]
    if faults and any(n for _, _, n in missed):
        where = ", ".join(f"{name} seed {s}" for name, s, n in missed if n)
        click.echo(
            f"xds: some --fault never struck (every request had ended first) in: {where}",
            err=True,
        )
    if as_json:
        if trace is not None:  # each replay's summary names its trace, as replay's does
            named = {"trace": trace, "trace_format": _trace_format(trace, fmt)}
            result = msgspec.structs.replace(
                result,
                variants=[
                    msgspec.structs.replace(
                        v,
                        summaries=[msgspec.structs.replace(s, **named) for s in v.summaries],
                    )
                    for v in result.variants
                ],
            )
        print(msgspec.json.encode(result).decode())
        return
    _print_comparison(result)


def _fault_name(i: int, faults: Sequence[object], specs: Sequence[str]) -> str:
    """Fault ``i`` of a run's faults: the config file's first, then the ``--fault`` specs."""
    from_file = len(faults) - len(specs)
    return f"faults[{i}] of the config" if i < from_file else escape(specs[i - from_file])


def _print_comparison(result: Comparison) -> None:
    """The table of ``xds compare``: each variant's means with their intervals, and each later
    variant's paired difference from the first."""
    from xds.serve.compare import METRICS

    seeds = result.seeds
    source = result.workload
    base = result.variants[0].name
    what = (
        f"seeds {seeds[0]}..{seeds[-1]}, mean ± 95 % interval"
        if len(seeds) > 1
        else f"seed {seeds[0]}"
    )
    table = Table(
        title=f"compare: {source} ({what})",
        caption=f"Δ: the paired difference from {base}; better or worse where its interval "
        "excludes 0, ~ where it does not (within the seeds' noise), - where there is none"
        if len(result.variants) > 1
        else None,
    )
    table.add_column("metric")
    for v in result.variants:
        table.add_column(f"{escape(v.name)} ({v.chips} chips)", justify="right", overflow="fold")
    for v in result.variants[1:]:
        table.add_column(f"Δ {escape(v.name)}", justify="right", overflow="fold")
    for m in METRICS:
        unit = "%" if m.unit == "share" else m.unit
        cells = [
            _spread_cell(v.metrics[m.key].mean, v.metrics[m.key].ci95, m.unit)
            for v in result.variants
        ]
        for v in result.variants[1:]:
            d = result.difference(v.name, m.key)
            verdict = {None: "~", True: "better", False: "worse"}[d.better]
            if math.isnan(d.ci95):  # one seed, or the metric undefined: no interval
                verdict = "-"
            cells.append(f"{_spread_cell(d.mean, d.ci95, m.unit, signed=True)} {verdict}")
        table.add_row(f"{m.label} ({unit})", *cells)
    console.print(table)
    if len(seeds) < 2:
        console.print("one seed: no intervals; --seeds 5 tells a difference from the noise")


def _spread_cell(mean: float, ci95: float, unit: str, *, signed: bool = False) -> str:
    """``mean ± ci95`` in the unit's format ("-" where undefined)."""
    if math.isnan(mean):
        return "-"
    digits = {"share": 1, "requests": 1, "per chip": 3}.get(unit, 2)
    scale = 100.0 if unit == "share" else 1.0
    text = f"{mean * scale:{'+' if signed else ''},.{digits}f}"
    if not math.isnan(ci95):
        text += f" ± {ci95 * scale:,.{digits}f}"
    return text


@app.command()
@click.option(
    "--config",
    "config_path",
    default=None,
    help="A .toml/.json file of ReliabilityConfig fields (faults included).",
)
@click.option(
    "--fault",
    "fault_specs",
    multiple=True,
    metavar="KIND:KEY=VALUE,...",
    help="Inject a fault, e.g. network_error:dp=2,iteration=4,layer=1 or "
    "executor_hang:dp=1,iteration=3; kinds: executor_hang, executor_crash, slow_iteration, "
    "network_error, memory_fault. Repeatable; added to the config's faults.",
)
@click.option(
    "--on-unhealthy",
    type=click.Choice(["restart", "scale_down", "report"]),
    default=None,
    help="What the control plane does with DPs that miss heartbeats (default: the config's).",
)
@_seed_option
@_backend_option
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def faults(
    config_path: str | None,
    fault_specs: tuple[str, ...],
    on_unhealthy: str | None,
    seed: int,
    backend: str,
    as_json: bool,
) -> None:
    """Inject faults into a decode group and watch SPEC 11's detection and recovery."""
    import msgspec

    from xds.config import load_config
    from xds.runtime import run
    from xds.serve.reliability import ReliabilityConfig, ReliableDecode, parse_fault

    cfg = load_config(config_path, ReliabilityConfig) if config_path else ReliabilityConfig()
    extra = tuple(parse_fault(spec) for spec in fault_specs)
    _no_fault_twice(fault_specs, extra, cfg.faults)
    changes: dict = {"faults": cfg.faults + extra}
    if on_unhealthy is not None:
        changes["heartbeat"] = msgspec.structs.replace(cfg.heartbeat, on_unhealthy=on_unhealthy)
    with _names_fault_spec(fault_specs, offset=len(cfg.faults)):
        cfg = msgspec.structs.replace(cfg, **changes)
    res = run(lambda: ReliableDecode(cfg).run(), seed=seed, backend=backend, event_log=False)  # type: ignore[arg-type]
    if as_json:
        print(msgspec.json.encode(res).decode())
        return
    table = Table(title=f"faults: {cfg.dps} DPs x batch {cfg.batch_per_dp}, {cfg.layers} layers")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("faults injected", str(len(cfg.faults)))
    if res.unfired:  # their DP was gone, or the run stopped or ended first
        table.add_row(
            "faults that never struck",
            ", ".join(_fault_name(i, cfg.faults, fault_specs) for i in res.unfired),
        )
    table.add_row("requests completed", f"{res.completed()} of {len(res.outcomes)}")
    table.add_row("iterations committed", f"{res.iterations} of {cfg.output_tokens - 1}")
    table.add_row("virtual time", fmt_ns(res.elapsed_ns))
    table.add_row("stopped", escape(res.stopped) or "no: ran to completion")
    console.print(table)
    if res.rollbacks:
        rb = Table(
            title="rollbacks (SPEC 11.2 stage 3; code SCALE_DOWN: the abort of a scale-down, "
            "whose survivors redo the iteration, not counted against max_retries)"
        )
        for col in (
            "iteration",
            "attempt",
            "code",
            "from DP",
            "broadcast",
            "slowest reach",
            "redo",
        ):
            rb.add_column(col, justify="right")
        for r in res.rollbacks:
            reach = max(r.observed_ns.values(), default=r.broadcast_ns) - r.broadcast_ns
            rb.add_row(
                str(r.iteration),
                str(r.attempt),
                r.code,
                str(r.origin_dp),
                fmt_ns(r.broadcast_ns),
                fmt_ns(max(0, reach)),
                fmt_ns(r.redo_ns) if r.redo_ns >= 0 else "-",
            )
        console.print(rb)
    if res.verdicts:
        hb = Table(
            title="heartbeat verdicts (TE-shell; executor stopped = by an injected hang or "
            "crash; no = a false positive, or a DP stalled behind another's fault)"
        )
        for col in ("DP", "ping sent", "marked", "control plane saw", "executor stopped"):
            hb.add_column(col, justify="right")
        for v in res.verdicts:
            seen = fmt_ns(v.seen_by_control_plane_ns) if v.seen_by_control_plane_ns >= 0 else "-"
            hb.add_row(
                str(v.dp),
                fmt_ns(v.ping_ns),
                fmt_ns(v.marked_ns),
                seen,
                "yes" if v.fault_injected else "no",
            )
        console.print(hb)
    for sd in res.scale_downs:
        console.print(
            f"scale-down at {fmt_ns(sd.at_ns)}: removed DP "
            f"{', '.join(map(str, sd.removed))}, {sd.live_dps} DPs "
            f"left, expert time x{sd.expert_scale:.2f}, every expert on >= {sd.min_replicas} die"
        )
    reasons: dict[str, int] = {}
    for o in res.failed():
        reasons[o.reason] = reasons.get(o.reason, 0) + 1
    for reason, n in sorted(reasons.items()):
        console.print(f"failed x{n}: {escape(reason)}")


@app.command()
@click.option(
    "--slow",
    "slow_specs",
    multiple=True,
    metavar="COMPONENT:EXTRA_US",
    help="Slow a component, e.g. attention:0:200 (each of its steps 200 us longer) or "
    "expert:2:300. Repeatable.",
)
@click.option(
    "--duplicates",
    type=_Finite(0, 1),
    default=0.0,
    show_default=True,
    help="Probability that a link delivers a message twice.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Requests decoded (each to the workload's output length).",
)
@click.option(
    "--queue-depth",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Messages each worker's inbox and each link hold before the sender blocks (backpressure).",
)
@_seed_option
@click.option("--json", "as_json", is_flag=True, help="Print both results as JSON.")
def dataflow(
    slow_specs: tuple[str, ...],
    duplicates: float,
    requests: int,
    queue_depth: int,
    seed: int,
    as_json: bool,
) -> None:
    """Synchronous A2E/E2A vs the dataflow mode (SPEC 10.4) on a small MoE-attention
    deployment: the same tokens, and who waits for a slow component."""
    import msgspec

    from xds.runtime import run
    from xds.serve.dataflow import ComponentDelay, Dataflow, DataflowConfig, reference_tokens

    delays = []
    for spec in slow_specs:
        if spec.count(":") < 2:
            raise click.UsageError(
                f"--slow {spec}: expected COMPONENT:EXTRA_US, e.g. attention:0:200 (the extra "
                "delay in us is missing)"
            )
        component, _, extra = spec.rpartition(":")
        try:
            extra_us = float(extra)
        except ValueError:
            raise click.UsageError(
                f"--slow {spec}: expected COMPONENT:EXTRA_US, e.g. attention:0:200"
            ) from None
        if not math.isfinite(extra_us) or not 0 <= extra_us <= 1e9:
            raise click.UsageError(
                f"--slow {spec}: the extra delay must be 0..1e9 us, got {extra}"
            ) from None
        extra_ns = round(extra_us * 1e3)
        try:
            delays.append(ComponentDelay(component=component, extra_ns=extra_ns))
        except ConfigError as exc:
            raise click.UsageError(f"--slow {spec}: {exc.message}") from None
    try:
        base = DataflowConfig(
            requests=requests,
            queue_depth=queue_depth,
            duplicate_probability=duplicates,
            delays=tuple(delays),
        )
    except ConfigError as exc:
        if (exc.field or "").startswith("delays"):
            raise click.UsageError(f"--slow: {exc.message}") from None
        raise
    reference = reference_tokens(base, run_seed=seed)
    results = {}
    for mode in ("sync", "dataflow"):
        cfg = msgspec.structs.replace(base, mode=mode)
        results[mode] = run(lambda cfg=cfg: Dataflow(cfg).run(), seed=seed, event_log=False)
    if as_json:
        print(msgspec.json.encode(results).decode())
        return
    table = Table(
        title=f"dataflow vs sync: {base.attention_workers} attention x {base.expert_workers} "
        f"expert workers, {requests} requests"
    )
    table.add_column("metric")
    for mode in results:
        table.add_column(mode, justify="right")

    def row(name: str, fn) -> None:
        table.add_row(name, *(fn(r) for r in results.values()))

    def latency(r, worker=None) -> float:
        xs = [x.finished_ns - x.admitted_ns for x in r.requests if worker in (None, x.worker)]
        return sum(xs) / len(xs) / 1e6 if xs else float("nan")

    def ms(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.2f} ms"  # (a worker given no request)

    row("virtual time", lambda r: fmt_ns(r.elapsed_ns))
    row("mean request latency", lambda r: ms(latency(r)))
    for w in range(base.attention_workers):
        row(f"  on attention worker {w}", lambda r, w=w: ms(latency(r, w)))
    row("messages", lambda r: f"{r.messages:,}")
    row("duplicates sent / dropped", lambda r: f"{r.duplicates_sent} / {r.duplicates_dropped}")
    row("largest queue (inbox / link)", lambda r: f"{r.max_queue['inbox']} / {r.max_queue['link']}")
    row(
        "tokens equal the dense reference",
        lambda r: "yes" if [x.tokens for x in r.requests] == reference else "NO",
    )
    if any(r.duplicates_sent != r.duplicates_dropped for r in results.values()):
        table.caption = (
            "a duplicate is dropped when it reaches its receiver: the rest were still on their "
            "way when the last request finished"
        )
    console.print(table)


_FLAG_OF_FIELD = {
    "fault": "--fault",
    "component": "--slow",
    "duplicate_probability": "--duplicates",
    "server": "--fault",
    "faults": "--fault",
    "rate_scale": "--rate-scale",
    "rate_per_s": "--rate",
    "max_scale": "--max-scale",
    "min_scale": "--min-scale",
    "start": "--start",
    "ttft_ms": "--ttft-ms",
    "tpot_ms": "--tpot-ms",
    "goodput_target": "--goodput",
    "bisections": "--bisections",
    "deployment": "--deployment",
    "limit": "--limit",
    "cv": "--cv",
    "from_token": "--from-token",
}
"""Library fields that a command-line flag sets: errors about them name the flag."""


_FAULT_FIELD = re.compile(r"faults\[(\d+)\]\.?(.*)")
"""A field of the i-th fault: ``faults[i].dp`` (group 1: i; group 2: the field, maybe empty)."""


def _cli_key(field: str | None) -> str:
    """The ``--fault`` key of a fault's field: its times are given in seconds, so
    ``duration_ns`` is ``duration``."""
    return (field or "").removesuffix("_ns")


@contextlib.contextmanager
def _names_fault_spec(specs: Sequence[str], *, offset: int = 0) -> Iterator[None]:
    """A ConfigError about ``faults[i]`` names the ``--fault`` spec it came from (the first
    ``offset`` faults came from a config file, which names itself)."""
    try:
        yield
    except ConfigError as exc:
        which = _FAULT_FIELD.match(exc.field or "")
        k = int(which[1]) - offset if which and exc.source is None else -1
        if not 0 <= k < len(specs):
            raise
        what = f" {_cli_key(which[2])}:" if which and which[2] else ""
        raise click.UsageError(f"--fault {specs[k]}:{what} {exc.message}") from None


@contextlib.contextmanager
def _names_deployment_file(deployment: str) -> Iterator[None]:
    """A ConfigError about a deployment field, raised once the deployment meets the workload
    (a prefix block size its hashes do not match, say), names the deployment's file, as the
    errors found when reading it do."""
    from xds.config import in_file
    from xds.serve.replay import PDConfig

    try:
        yield
    except ConfigError as exc:
        top = re.split(r"[.\[]", exc.field or "")[0]
        is_file = Path(deployment).suffix.lower() in (".toml", ".json")
        if exc.source is None and is_file and top in PDConfig.__struct_fields__:
            raise in_file(exc, deployment) from None
        raise


@contextlib.contextmanager
def _names_variant_file(deployments: Sequence[str]) -> Iterator[None]:
    """A ConfigError of :func:`xds.serve.compare.compare` about a variant's deployment field
    names the deployment (its file, if it came from one), as ``xds replay`` would."""
    from xds.serve.compare import variant_field

    try:
        yield
    except ConfigError as exc:
        for name in deployments:
            prefix = f"{variant_field(name)}.config."
            if exc.source is None and (exc.field or "").startswith(prefix):
                inner = ConfigError(exc.message, field=(exc.field or "")[len(prefix) :])
                try:
                    with _names_deployment_file(name):
                        raise inner
                except ConfigError as named:
                    if named is not inner:  # a file's field, named in the file
                        raise named from None
                raise ConfigError(f"--deployment {name}: {inner}") from None  # a preset
        raise


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    terminated: list[int] = []
    try:
        with warnings.catch_warnings(), _terminate_as_interrupt(terminated):
            warnings.showwarning = _show_warning
            result = app.main(args=args, standalone_mode=False, prog_name="xds")
    except click.UsageError as exc:
        message = exc.format_message()
        if isinstance(exc, click.NoSuchOption) and exc.option_name == "--import":
            message = "--import goes before the command: xds --import MODULE replay ..."
        elif isinstance(exc, click.NoSuchOption) and exc.option_name == "--version":
            message += " (the version: `xds version`)"
        elif isinstance(exc, click.NoSuchOption):
            elsewhere = _commands_with_option(exc.option_name)
            if elsewhere and exc.ctx is not None and exc.ctx.info_name not in elsewhere:
                message = (
                    f"No such option for {exc.ctx.info_name}: {exc.option_name} (an option of "
                    f"{', '.join(f'xds {c}' for c in elsewhere)})"
                )
        elif message == "No such command 'help'.":
            message += " Every command has --help: `xds --help`, `xds replay --help`, ..."
        print(f"xds: error: {message}", file=sys.stderr)
        return 2
    except (click.exceptions.Abort, KeyboardInterrupt):
        print("xds: terminated" if terminated else "xds: aborted", file=sys.stderr)
        return 143 if terminated else 130
    except ConfigError as exc:
        flag = _FLAG_OF_FIELD.get(exc.field or "") if exc.source is None else None
        fault = _FAULT_FIELD.match(exc.field or "")
        if fault and exc.source is None:  # the k-th --fault of the command line
            flag = f"--fault #{int(fault[1]) + 1}" + (f" {_cli_key(fault[2])}" if fault[2] else "")
        print(f"xds: error: {f'{flag}: {exc.message}' if flag else exc}", file=sys.stderr)
        return 2
    except XdsError as exc:
        print(f"xds: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        policy_error = _policy_error(exc)
        if policy_error is None:
            raise  # a bug in xds: the whole traceback is what a report needs
        print(policy_error, file=sys.stderr)
        return 1
    return int(result) if isinstance(result, int) else 0


def _commands_with_option(option: str) -> list[str]:
    """The commands that take ``option`` (for the error of one given to another command)."""
    return [
        name
        for name, command in sorted(app.commands.items())
        if any(option in param.opts for param in command.params)
    ]


@contextlib.contextmanager
def _terminate_as_interrupt(terminated: list[int]) -> Iterator[None]:
    """During the command, SIGTERM stops it as Ctrl-C does (worker processes stopped, no
    traceback), noting the signal in ``terminated``; outside the main thread nothing changes."""
    import signal

    def handler(signum: int, frame: object) -> None:
        terminated.append(signum)
        # the interrupt can land where Python ignores it (an at-fork hook such as logging's,
        # a finalizer): raise it again every 50 ms until the command has stopped
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        raise KeyboardInterrupt

    def again(signum: int, frame: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    previous_alarm = signal.signal(signal.SIGALRM, again)
    previous_hook = sys.unraisablehook

    def quiet(unraisable: Any) -> None:  # the ignored interrupt: no "Exception ignored" text
        if not (terminated and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            previous_hook(unraisable)

    sys.unraisablehook = quiet
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning xds gives the user (a UserWarning) as one ``xds: warning:`` line on stderr;
    any other kind as Python shows it."""
    if issubclass(category, UserWarning):
        print(f"xds: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _policy_error(exc: BaseException) -> str | None:
    """An error raised by a ``--policy`` function of the user's: its message, the slot and
    request it was asked about, and the user's own frames only (not xds's or click's);
    None for any other error."""
    import traceback

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if getattr(exc, "xds_policy", None) is None:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not _is_library_frame(f.filename)] or frames[-1:]
    lines = [f"xds: error: {type(exc).__name__}: {exc}"]
    lines += [note for note in getattr(exc, "__notes__", [])]
    lines += [f"  {f.filename}, line {f.lineno}, in {f.name}: {f.line}" for f in own[-5:]]
    return "\n".join(lines)


@functools.cache
def _frame_dirs() -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(directories of xds, anyio and click; the standard library's; the site-packages
    directories, which an installation without a venv keeps under the standard library's and
    which hold the user's installed code)."""
    import os
    import sysconfig

    import anyio

    import xds

    def folder(path: str) -> str:
        return os.path.join(os.path.realpath(path), "")

    paths = sysconfig.get_paths()
    ours = tuple(folder(os.path.dirname(m.__file__)) for m in (xds, anyio, click))  # type: ignore[type-var]
    packages = tuple(folder(paths[k]) for k in ("purelib", "platlib"))
    return ours, folder(paths["stdlib"]), packages


def _is_library_frame(filename: str) -> bool:
    """A frame of xds, anyio, click or the standard library, not of the user's code."""
    import os

    ours, stdlib, packages = _frame_dirs()
    path = os.path.realpath(filename)
    return path.startswith(ours) or (path.startswith(stdlib) and not path.startswith(packages))


if __name__ == "__main__":
    raise SystemExit(main())
