"""docs/results.md's sections: each renders one snapshot (docs/results/<name>.json) as Markdown
lines, from the snapshot alone; SECTIONS lists them in the doc's order. scripts/results.py records
the snapshots and renders the doc from them."""

from __future__ import annotations

from collections.abc import Callable


def flow(shape: dict) -> str:
    """A tree shape as conf/methods writes it, its kind first: {kind: chain, depth: 3}."""
    items = sorted(shape.items(), key=lambda item: item[0] != "kind")
    return "{" + ", ".join(f"{key}: {value}" for key, value in items) + "}"


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def alphas(values: list | None) -> str:
    return " / ".join(f"{a:.2f}" for a in values or [] if a is not None) or "–"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def run_lines(run: dict) -> list[str]:
    """How an entry was measured: machine, command and commit, prompts, conditions."""
    commit = f" at commit {run['commit']}" if run.get("commit") else ""
    prompts = f"; prompts: {run['prompts']}" if run.get("prompts") else ""
    return [
        f"- {run['machine']}: `{run['command']}`{commit}{prompts}",
        f"- conditions: {run['conditions']}",
        "",
    ]


def quickstart_section(snapshot: dict) -> list[str]:
    lines = ["## Quickstart (`make run`)", "", snapshot["about"], ""]
    for entry in snapshot["entries"]:
        run = entry["run"]
        lines += [f"### {run['machine_class']}: run `{run['name']}`", "", *run_lines(run)]
        rows = [
            [
                m,
                fmt(r.get("tau")),
                alphas(r.get("acceptance_per_depth")),
                fmt(r.get("tokens_per_s"), ".1f"),
                fmt(r.get("speedup"), ".2f", "×"),
                r.get("identical", "–"),
            ]
            for m, r in entry["methods"].items()
            if m != "plain"  # the yardstick: its tok/s is each row's ÷ its × plain
        ]
        lines += table(["method", "τ", "α per depth", "tok/s", "× plain", "identical to plain"], rows)
    return lines


def decoder_section(snapshot: dict) -> list[str]:
    lines = ["## The decoder's own speed (`specdraft-bench methods=decoder`)", "", snapshot["about"], ""]
    for entry in snapshot["entries"]:
        lines += [f"### {entry['run']['machine_class']}", "", *run_lines(entry["run"])]
        rows = [
            [
                m,
                fmt(r.get("tokens_per_s")),
                fmt(r.get("speedup"), ".3f", "×"),
                fmt(r.get("tau")),
                fmt(r.get("mean_nodes"), ".0f"),
                fmt(r.get("draft_ms"), ".1f"),
                fmt(r.get("verify_ms"), ".1f"),
                fmt(r.get("bookkeeping_ms"), ".1f"),
                r.get("identical", "–"),
            ]
            for m, r in entry["methods"].items()
        ]
        header = ["method", "tok/s", "× plain", "τ", "nodes", "draft ms", "verify ms", "bookkeeping ms"]
        lines += table([*header, "identical to plain"], rows)
        trees = ", ".join(f"`{m}` {shape}" for m, shape in entry["shapes"].items())
        if auto := entry.get("auto"):
            lines += [
                f"`head_auto` (`shape: auto`) chose `{flow(auto['chosen'])}`: predicted "
                f"{auto['predicted_tokens_per_s']:.1f} tok/s, {auto['measured_tokens_per_s']:.1f} decoding "
                f"its calibration prompts. Trees: {trees}.",
                "",
            ]
    return lines


def interval(compared: dict | None, key: str, spec: str) -> str:
    if compared is None:
        return "1 (reference)" if key == "ratio" else "–"
    found = compared[key]
    return f"{found['estimate']:{spec}} [{found['low']:{spec}}, {found['high']:{spec}}]"


def thousandths(values: list) -> str:
    return " / ".join(f"{a:.3f}" for a in values)


ABLATION_TITLE = "## The equal-token ablation: the same data, the same training tokens"
BLOCK_TITLE = "## A block drafter (DFlash) against EAGLE heads: the same data, the same training tokens"


def comparison_section(title: str) -> Callable[[dict], list[str]]:
    """The renderer of an equal-token comparison of heads (scripts/results.py comparison_entry)."""
    return lambda snapshot: comparison_lines(title, snapshot)


def comparison_lines(title: str, snapshot: dict) -> list[str]:
    """Each head's training run, then every method per prompt set, paired with the reference."""
    lines = [title, "", *run_lines(snapshot["run"])]
    if snapshot.get("about"):
        lines += [snapshot["about"], ""]
    lines += block_training_lines(snapshot["training"])
    reference, shapes = snapshot["reference"], snapshot["shapes"]
    greedy, sampled = (dict(ordered(snapshot, snapshot["results"].get(t, {}))) for t in ("T=0", "T=1"))
    rows = []
    for name in snapshot["prompt_sets"]:
        at0, at1 = greedy.get(name, {}), sampled.get(name, {})
        lookup = (at0.get("hf_prompt_lookup") or {}).get("tokens_per_s")
        rows += [
            [
                prompt_count(snapshot["prompts"], name),
                method,
                *block_greedy_cells(at0.get(method), lookup, method == reference),
                *block_sampled_cells(at1.get(method), method == reference),
            ]
            for method in snapshot["methods"]
            if method in at0 or method in at1
        ]
    header = ["prompts", "method", "τ", "α per depth", "tok/s", "× plain", "× HF prompt lookup"]
    header += ["τ ÷ ref [95% CI]", "tok/s ÷ ref [95% CI]", "draft / verify ms", "identical to plain"]
    header += ["τ T=1", "τ ÷ ref T=1 [95% CI]", "tok/s ÷ ref T=1 [95% CI]", "× plain T=1"]
    lead = f"T=0 and, in the T=1 columns, the methods run at T=1, every method paired with `{reference}`:"
    lines += [lead, "", *table(header, rows)]
    by_shape: dict[str, list[str]] = {}  # methods sharing a tree are named once, together
    for method in snapshot["methods"]:
        if method in shapes:
            by_shape.setdefault(shapes[method], []).append(f"`{method}`")
    trees = "; ".join(f"{', '.join(methods)} {shape}" for shape, methods in by_shape.items())
    return [*lines, f"Shapes: {trees}.", ""] if trees else lines


def block_training_lines(training: list[dict]) -> list[str]:
    """Each head's training run, in the order ``--training`` named them."""
    rows = [
        [
            t["head"],
            t["kind"] or "–",
            t["settings"] or "–",
            f"{t['global_step']:,}",
            f"{t['tokens_seen']:,}",
            fmt(t["train_tokens_per_s"], ",.0f"),
            fmt(t["trainable_parameters"] and t["trainable_parameters"] / 1e6, ".1f", "M"),
            thousandths(t["acc"][:4]) or "–",
            fmt(t["sim_tau"], ".3f"),
        ]
        for t in training
    ]
    header = ["head", "kind", "settings", "steps", "tokens seen", "train tokens/s", "trainable"]
    return table([*header, "held-out acc_1..4 (final)", "simulated τ (final)"], rows)


def prompt_count(prompts: dict, name: str) -> str:
    """A prompt set and its count at T=0, and at T=1 too where that differs."""
    greedy, sampled = prompts["T=0"].get(name), prompts.get("T=1", {}).get(name)
    return f"{name} ({greedy})" if sampled in (None, greedy) else f"{name} ({greedy}; T=1: {sampled})"


def block_greedy_cells(r: dict | None, lookup: float | None, is_reference: bool) -> list[str]:
    """A method's T=0 cells; ``lookup``: HF prompt lookup's tok/s on the same prompt set."""
    if r is None:
        return ["–"] * 9
    return [
        fmt(r.get("tau")),
        alphas((r.get("acceptance_per_depth") or [])[:7]),
        fmt(r.get("tokens_per_s"), ".1f"),
        fmt(r.get("speedup"), ".2f", "×"),
        fmt(r["tokens_per_s"] / lookup if lookup and "tokens_per_s" in r else None, ".2f", "×"),
        paired(r, "ratio", is_reference),
        paired(r, "speed_ratio", is_reference),
        f"{fmt(r.get('draft_ms'), '.1f')} / {fmt(r.get('verify_ms'), '.1f')}",
        r.get("identical", "–"),
    ]


def block_sampled_cells(r: dict | None, is_reference: bool) -> list[str]:
    """A method's T=1 cells: "–" where it did not run at T=1."""
    if r is None:
        return ["–"] * 4
    return [
        fmt(r.get("tau")),
        paired(r, "ratio", is_reference),
        paired(r, "speed_ratio", is_reference),
        fmt(r.get("speedup"), ".2f", "×"),
    ]


def ordered(snapshot: dict, sets: dict) -> list[tuple[str, dict]]:
    """A temperature's prompt sets and their methods in the snapshot's order (as the bench ran)."""
    return [
        (name, {m: sets[name][m] for m in snapshot["methods"] if m in sets[name]})
        for name in snapshot["prompt_sets"]
        if name in sets
    ]


def paired(row: dict, key: str, is_reference: bool) -> str:
    """A method's ``key`` interval against the reference; "–" where it was not paired."""
    if is_reference:
        return "1 (reference)" if key == "ratio" else "1"
    compared = row.get("against_reference")
    return interval(compared, key, ".3f") if compared and compared.get(key) else "–"


def depth_header(reference: str) -> list[str]:
    features = ["α own features d1..d4", "α target features d1..d4", "chain τ own / target"]
    return [*features, f"own chain τ ÷ {reference} [95% CI]"]


def depth_cells(run: dict | None) -> list[str]:
    """The own- vs target-feature chain acceptance per depth (specdraft-depth-acceptance); "–"
    where the head had no such run."""
    if run is None:
        return ["–"] * 4
    own, target = run["own_features"], run["target_features"]
    return [
        thousandths(own["acceptance_per_depth"]),
        thousandths(target["acceptance_per_depth"]),
        f"{own['chain_tau']:.3f} / {target['chain_tau']:.3f}",
        interval(run.get("against_reference"), "ratio", ".3f"),
    ]


def sweep_section(snapshot: dict) -> list[str]:
    lines = ["## HASS loss-weight sweep (Hydra multirun, W&B offline)", "", *run_lines(snapshot["run"])]
    swept, depth = snapshot["swept"], snapshot["depth"]
    rows = []
    for point, run in sweep_pairs(snapshot["points"], depth["runs"], swept):
        if point is None:  # a depth run no point matched: its name in the first column
            rows.append([run, *["–"] * (len(swept) + 2), *depth_cells(depth["runs"][run])])
            continue
        rows.append(
            [
                *(str(point["values"][key]) for key in swept),
                f"{point['best_sim_tau']:.3f}",
                f"{point['sim_tau']:.3f}",
                thousandths(point["acc"]),
                *depth_cells(depth["runs"].get(run)),
            ]
        )
    header = [*swept, "best simulated τ", "final simulated τ", "final acc_1..4", *depth_header("EAGLE")]
    return [*lines, depth["about"], "", *table(header, rows)]


def sweep_pairs(points: list[dict], runs: dict, swept: list[str]) -> list[tuple[dict | None, str | None]]:
    """Each sweep point with its depth run, keyed "key=value,key=value" by the swept values; the
    yardstick (no swept values) and its run, named otherwise, pair up as the one left on each side.
    A run left beyond that gets a row of its own, so no measurement drops out."""
    keyed = {values: name for name in runs if (values := run_values(name, swept)) is not None}
    names = [keyed.get(tuple(number(point["values"].get(key)) for key in swept)) for point in points]
    left = [name for name in runs if name not in names]
    unmatched = [i for i, name in enumerate(names) if name is None]
    if len(left) == 1 and len(unmatched) == 1:
        names[unmatched[0]] = left.pop()
    return [*zip(points, names, strict=True), *((None, name) for name in left)]


def run_values(name: str, swept: list[str]) -> tuple | None:
    """A depth run's swept values from its name ("key=value,key=value"); None where it is not so named."""
    pairs = [part.partition("=") for part in name.split(",")]
    values = {key: number(value) for key, sep, value in pairs if sep}
    if len(values) != len(pairs) or set(values) != set(swept):
        return None
    return tuple(values[key] for key in swept)


def number(value: object) -> object:
    """A swept value compared as a number where it is one: 2, 2.0 and "2.0" are the same point."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def lookahead_section(snapshot: dict) -> list[str]:
    title = "## Lookahead decoding, HF prompt lookup and a trained head (`methods=lookahead`)"
    lines = [title, "", *run_lines(snapshot["run"])]
    rows = [
        [
            name,
            m,
            fmt(r.get("tokens_per_s")),
            fmt(r.get("speedup"), ".3f", "×"),
            fmt(r.get("tau")),
            fmt(r.get("mean_nodes"), ".1f"),
            r.get("identical", "–"),
        ]
        for name, methods in snapshot["results"].items()
        for m, r in methods.items()
    ]
    header = ["prompts", "method", "tok/s", "× plain", "tokens per step", "nodes per step"]
    return [*lines, *table([*header, "identical to plain"], rows), snapshot["about"], ""]


LLAMACPP_TITLE = "## Serving on a CPU: llama.cpp with our EAGLE-3 head (`scripts/interop/bench_llamacpp.py`)"


def llamacpp_section(snapshot: dict) -> list[str]:
    """llama.cpp plain / with our head / with its n-gram drafting, beside specdraft's decoder, and
    the target's forward cost that explains the step. Variants of one method share a row
    (:func:`llamacpp_family`), their cells joined by " / " (α per position by "; ")."""
    rows: dict[str, list[tuple[str, dict]]] = {}
    for name, r in sorted(snapshot["methods"].items(), key=lambda item: llamacpp_order(*item)):
        family, variant = llamacpp_family(name, r)
        rows.setdefault(family, []).append((variant, r))
    header = ["method", "engine", "tok/s", "× llama.cpp plain", "τ", "α per position", "ms per step (draft)"]
    header += ["× plain, every draft accepted", "identical to plain"]
    costs = ", ".join(f"{k}: {ms:.1f}" for k, ms in snapshot["forward_ms"].items())
    return [
        LLAMACPP_TITLE,
        "",
        *run_lines(snapshot["run"]),
        *table(header, [llamacpp_row(family, group) for family, group in rows.items()]),
        f"llama.cpp's forward of k new tokens through the target, ms (median; about what verifying k − 1 "
        f"drafts costs): {costs}. {snapshot['about']}",
        "",
    ]


def llamacpp_order(name: str, r: dict) -> tuple:
    """llama.cpp first, plain decoding first within an engine, then by draft length."""
    return (r["engine"] != "llama.cpp", "plain" not in name, r.get("draft_length") or 0, name)


def llamacpp_family(name: str, r: dict) -> tuple[str, str]:
    """(the row a method shares, its variant there): a head's GGUF weight types per draft length
    (``llamacpp_<kind>_<type>_n<n>``), llama.cpp's n-gram settings, specdraft's plain decoding and head."""
    if r.get("draft_length"):
        kind, variant = name.removeprefix("llamacpp_").split("_", 1)
        return f"{kind} n={r['draft_length']}", variant.rsplit("_n", 1)[0]
    for family in ("llamacpp_ngram", "specdraft"):
        if name.startswith(family + "_"):
            return family, name.removeprefix(family + "_")
    return name, ""


MAX_ALPHAS = 6  # n-gram drafts reach 48 positions: the first few say enough


def llamacpp_row(family: str, group: list[tuple[str, dict]]) -> list[str]:
    """One row: a family names its variants and joins their cells."""

    def each(cell, separator: str = " / ") -> str:
        return separator.join(cell(r) for _, r in group)

    def alpha_cell(r: dict) -> str:
        rates = r.get("acceptance_per_position") or r.get("acceptance_per_depth") or []
        return alphas(rates[:MAX_ALPHAS]) + (" …" if len(rates) > MAX_ALPHAS else "")

    named = [variant for variant, _ in group if variant]
    variants = f" ({' / '.join(named)})" if named else ""
    return [
        family + variants,
        group[0][1]["engine"],
        each(lambda r: fmt(r["tokens_per_s"], ".1f")),
        each(lambda r: fmt(r["x_llamacpp_plain"], ".2f", "×")),
        each(lambda r: fmt(r.get("tau"))),
        each(alpha_cell, "; "),
        each(step_cell),
        each(lambda r: fmt(r.get("ceiling_x_llamacpp_plain"), ".2f", "×")),
        each(lambda r: r["identical_to_plain"]),
    ]


def step_cell(r: dict) -> str:
    """A decoding step's ms and, in parentheses, its drafting part."""
    if "step_ms" in r:  # llama.cpp
        return f"{r['step_ms']:.1f} ({r['draft_ms_per_step']:.1f})"
    parts = [r.get(key) for key in ("draft_ms", "verify_ms", "bookkeeping_ms")]
    return "–" if None in parts else f"{sum(parts):.1f} ({parts[0]:.1f})"


# per drafting method at each batch size, besides its speed: the same at every B -> the closing
# sentence, varying -> a column of its own
BATCH_PER_METHOD = {"tau": "τ", "identical_to_plain": "identical to plain"}


def batch_section(snapshot: dict) -> list[str]:
    lines = ["## Throughput against batch size (`methods=batch`)", "", *run_lines(snapshot["run"])]
    sizes = snapshot["batch"]["sizes"]
    methods = list(dict.fromkeys(m for at in sizes.values() for m in at))  # the snapshot's order
    values = {
        (m, key): [batch_value(at.get(m), key) for at in sizes.values()]
        for m in methods
        if m != "plain"  # τ 1, the yardstick of identical
        for key in BATCH_PER_METHOD
    }
    constant = {pair: found[0] for pair, found in values.items() if len(set(found)) == 1}
    varying = [pair for pair in values if pair not in constant]
    header = ["B"]
    for m in methods:
        header += [f"{m} tok/s" if m == "plain" else f"{m} tok/s (× plain)", f"{m} ms/token/row"]
        header += [f"{m} {BATCH_PER_METHOD[key]}" for method, key in varying if method == m]
    rows = []
    for size, at in sizes.items():
        row = [size]
        for m in methods:
            row += batch_speed_cells(at.get(m), m == "plain")
            row += [batch_value(at.get(m), key) for method, key in varying if method == m]
        rows.append(row)
    crossover = ", ".join(
        f"`{m}` {snapshot['shapes'][m]}: {b}" for m, b in snapshot["batch"]["crossover"].items()
    )
    same = "; ".join(
        f"{label}: " + ", ".join(f"`{m}` {value}" for (m, k), value in constant.items() if k == key)
        for key, label in BATCH_PER_METHOD.items()
        if any(k == key for _, k in constant)
    )
    closing = f"The batch size from which a tree is no faster than plain decoding: {crossover}."
    return [*lines, *table(header, rows), closing + (f" At every B, {same}." if same else ""), ""]


def batch_value(r: dict | None, key: str) -> str:
    if r is None:
        return "–"
    return fmt(r.get(key)) if key == "tau" else r.get(key, "–")


def batch_speed_cells(r: dict | None, is_plain: bool) -> list[str]:
    """tok/s over all rows (and × plain at that B), ms per token per row."""
    if r is None:
        return ["–", "–"]
    speed = fmt(r["tokens_per_s"]) + ("" if is_plain else f" ({fmt(r['speedup'], '.3f', '×')})")
    return [speed, fmt(r["row_ms_per_token"], ".1f")]


def train_speed_section(snapshot: dict) -> list[str]:
    lines = ["## Training speed per head kind (`scripts/bench_train_step.py`)", "", snapshot["about"], ""]
    classes = [entry["run"]["machine_class"] for entry in snapshot["entries"]]
    variants = sorted({v for entry in snapshot["entries"] for v in entry["train_tokens_per_s"]})
    rows = [
        [f"`{v}`", *(fmt(e["train_tokens_per_s"].get(v), ".0f") for e in snapshot["entries"])]
        for v in variants
    ]
    lines += table(["variant", *(f"train tokens/s, {c}" for c in classes)], rows)
    for entry in snapshot["entries"]:
        run = entry["run"]
        lines.append(
            f"- {run['machine_class']}: {run['machine']}; `{run['command']}` at commit {run['commit']}. "
            + run["conditions"]
        )
    return [*lines, ""]


def recipe_section(snapshot: dict) -> list[str]:
    lines = ["## Recipe variants of the quickstart's head (one GPU)", "", *run_lines(snapshot["run"])]
    rows = [
        [
            r["run"],
            r["differs"],
            f"{r['steps']:,}",
            f"{r['tokens']:,}",
            f"{r['sim_tau']:.3f}",
            " / ".join(f"{a:.3f}" for a in r["acc"]),
        ]
        for r in snapshot["runs"]
    ]
    lines += table(["run", "differs by", "steps", "tokens", "simulated τ", "acc_1..4"], rows)
    return [*lines, snapshot["about"], ""]


def regen_section(snapshot: dict) -> list[str]:
    lines = ["## Regeneration on one GPU, plain and capturing the features", "", *run_lines(snapshot["run"])]
    runs = snapshot["runs"]
    base = runs[-1]  # the oldest code, listed last
    rows = [
        [
            r["label"],
            r["commit"],
            str(r["rows"] or "–"),
            f"{r['generated_tokens']:,}",
            f"{r['seconds']:.0f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×",
        ]
        for r in runs
    ]
    lines += table(["run", "commit", "rows", "answer tokens", "s", "tokens/s", f"× {base['commit']}"], rows)
    return [*lines, snapshot["about"], ""]


def evidence_section(snapshot: dict) -> list[str]:
    rows = [[f"`{r['setting']}`", r["value"], r["evidence"]] for r in snapshot["rows"]]
    return [
        "## Evidence for today's defaults",
        "",
        snapshot["about"],
        "",
        *table(["setting", "value", "measured"], rows),
    ]


def reading_section(snapshot: dict) -> list[str]:
    return ["## Reading these numbers", "", *(f"- {item}" for item in snapshot["reading"]), ""]


# snapshot file (docs/results/<name>.json) -> its section's renderer, in the doc's order
SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "evidence": evidence_section,
    "quickstart": quickstart_section,
    "decoder": decoder_section,
    "ablation": comparison_section(ABLATION_TITLE),
    "block": comparison_section(BLOCK_TITLE),
    "sweep": sweep_section,
    "recipe": recipe_section,
    "lookahead": lookahead_section,
    "batch": batch_section,
    "llamacpp": llamacpp_section,
    "train_speed": train_speed_section,
    "regen": regen_section,
}
