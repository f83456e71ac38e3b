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
    lines = [f"- {run['machine']}: `{run['command']}`{commit}"]
    if run.get("prompts"):
        lines.append(f"- prompts: {run['prompts']}")
    return [*lines, f"- conditions: {run['conditions']}", ""]


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


def ablation_section(snapshot: dict) -> list[str]:
    lines = [
        "## The equal-token ablation: the same data, the same training tokens",
        "",
        *run_lines(snapshot["run"]),
    ]
    rows = [
        [
            head,
            str(t["global_step"]),
            f"{t['tokens_seen']:,}",
            " / ".join(f"{a:.3f}" for a in t["acc"]),
            f"{t['sim_tau']:.3f}",
        ]
        for head, t in snapshot["training"].items()
    ]
    lines += table(["head", "steps", "tokens seen", "held-out acc_1..4 (final)", "simulated τ (final)"], rows)
    greedy, sampled = snapshot["results"]["T=0"], snapshot["results"].get("T=1", {})
    for name, methods in greedy.items():
        prompts = next(
            m["against_reference"]["prompts"] for m in methods.values() if "against_reference" in m
        )
        lines += [f"{name} ({prompts} prompts), T=0 and T=1:", ""]
        rows = []
        for method, r in methods.items():
            if method == "plain":
                continue
            t1 = sampled.get(name, {}).get(method, {})
            rows.append(
                [
                    method.removesuffix("_tree"),
                    fmt(r.get("tau"), ".3f"),
                    alphas(r.get("acceptance_per_depth")),
                    interval(r.get("against_reference"), "ratio", ".3f"),
                    interval(r.get("against_reference"), "difference", "+.3f"),
                    fmt(r.get("speedup"), ".2f", "×"),
                    r.get("identical", "–"),
                    fmt(t1.get("tau"), ".3f"),
                    interval(t1.get("against_reference"), "ratio", ".3f"),
                    fmt(t1.get("speedup"), ".2f", "×"),
                ]
            )
        header = [
            "head",
            "τ",
            "α per depth",
            "τ ÷ EAGLE-2 [95% CI]",
            "Δτ [95% CI]",
            "speedup",
            "identical to plain",
        ]
        lines += table([*header, "τ T=1", "τ ÷ EAGLE-2 T=1 [95% CI]", "speedup T=1"], rows)
    return [*lines, *depth_lines(snapshot["depth"], "EAGLE-2")]


def block_section(snapshot: dict) -> list[str]:
    title = "## A block drafter (DFlash) against EAGLE heads: the same data, the same training tokens"
    lines = [title, "", *run_lines(snapshot["run"])]
    if snapshot.get("about"):
        lines += [snapshot["about"], ""]
    rows = [
        [
            t["head"],
            t["kind"] or "–",
            t["settings"] or "–",
            f"{t['global_step']:,}",
            f"{t['tokens_seen']:,}",
            fmt(t["train_tokens_per_s"], ",.0f"),
            fmt(t["trainable_parameters"] and t["trainable_parameters"] / 1e6, ".1f", "M"),
            " / ".join(f"{a:.3f}" for a in t["acc"][:4]) or "–",
            fmt(t["sim_tau"], ".3f"),
        ]
        for t in snapshot["training"]
    ]
    header = ["head", "kind", "settings", "steps", "tokens seen", "train tokens/s", "trainable"]
    lines += table([*header, "held-out acc_1..4 (final)", "simulated τ (final)"], rows)
    reference, shapes, prompts = snapshot["reference"], snapshot["shapes"], snapshot["prompts"]
    greedy, sampled = (ordered(snapshot, snapshot["results"].get(t, {})) for t in ("T=0", "T=1"))
    for name, methods in greedy:
        lines += [f"{name} ({prompts['T=0'][name]} prompts), T=0, paired with `{reference}`:", ""]
        lookup = (methods.get("hf_prompt_lookup") or {}).get("tokens_per_s")
        rows = [
            [
                method,
                shapes.get(method, "–"),
                fmt(r.get("tau")),
                alphas((r.get("acceptance_per_depth") or [])[:7]),
                fmt(r.get("tokens_per_s"), ".1f"),
                fmt(r.get("speedup"), ".2f", "×"),
                fmt(r["tokens_per_s"] / lookup if lookup and "tokens_per_s" in r else None, ".2f", "×"),
                paired(r, "ratio", method == reference),
                paired(r, "speed_ratio", method == reference),
                f"{fmt(r.get('draft_ms'), '.1f')} / {fmt(r.get('verify_ms'), '.1f')}",
                r.get("identical", "–"),
            ]
            for method, r in methods.items()
        ]
        header = ["method", "shape", "τ", "α per depth", "tok/s", "× plain", "× HF prompt lookup"]
        ratios = ["τ ÷ ref [95% CI]", "tok/s ÷ ref [95% CI]", "draft / verify ms", "identical to plain"]
        lines += table([*header, *ratios], rows)
    rows = [
        [
            f"{name} ({prompts['T=1'][name]})",
            method,
            fmt(r.get("tau")),
            paired(r, "ratio", method == reference),
            paired(r, "speed_ratio", method == reference),
            fmt(r.get("speedup"), ".2f", "×"),
        ]
        for name, methods in sampled
        for method, r in methods.items()
        if method != "plain"  # the yardstick of × plain
    ]
    if rows:
        header = ["prompts", "method", "τ", "τ ÷ ref [95% CI]", "tok/s ÷ ref [95% CI]", "× plain"]
        lines += [f"T=1, the methods run at T=1, paired with `{reference}`:", "", *table(header, rows)]
    return lines


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


def depth_lines(depth: dict, reference: str) -> list[str]:
    """The own- vs target-feature chain acceptance per depth (specdraft-depth-acceptance)."""
    rows = []
    for head, run in depth["runs"].items():
        own, target = run["own_features"], run["target_features"]
        rows.append(
            [
                head,
                " / ".join(f"{a:.3f}" for a in own["acceptance_per_depth"]),
                " / ".join(f"{a:.3f}" for a in target["acceptance_per_depth"]),
                f"{own['chain_tau']:.3f} / {target['chain_tau']:.3f}",
                interval(run.get("against_reference"), "ratio", ".3f"),
            ]
        )
    header = ["head", "α own features d1..d4", "α target features d1..d4", "chain τ own / target"]
    return [
        depth["about"],
        "",
        *table([*header, f"own chain τ ÷ {reference} [95% CI]"], rows),
    ]


def sweep_section(snapshot: dict) -> list[str]:
    lines = ["## HASS loss-weight sweep (Hydra multirun, W&B offline)", "", *run_lines(snapshot["run"])]
    swept = snapshot["swept"]
    rows = [
        [
            *(str(p["values"][key]) for key in swept),
            f"{p['best_sim_tau']:.3f}",
            f"{p['sim_tau']:.3f}",
            " / ".join(f"{a:.3f}" for a in p["acc"]),
        ]
        for p in snapshot["points"]
    ]
    lines += table([*swept, "best simulated τ", "final simulated τ", "final acc_1..4"], rows)
    return [*lines, *depth_lines(snapshot["depth"], "EAGLE")]


def lookahead_section(snapshot: dict) -> list[str]:
    title = "## Lookahead decoding, HF prompt lookup and a trained head (`methods=lookahead`)"
    lines = [title, "", *run_lines(snapshot["run"])]
    for name, methods in snapshot["results"].items():
        rows = [
            [
                m,
                fmt(r.get("tokens_per_s")),
                fmt(r.get("speedup"), ".3f", "×"),
                fmt(r.get("tau")),
                fmt(r.get("mean_nodes"), ".1f"),
                r.get("identical", "–"),
            ]
            for m, r in methods.items()
        ]
        lines += [
            f"{name}:",
            "",
            *table(
                ["method", "tok/s", "× plain", "tokens per step", "nodes per step", "identical to plain"],
                rows,
            ),
        ]
    return [*lines, snapshot["about"], ""]


def batch_section(snapshot: dict) -> list[str]:
    lines = ["## Throughput against batch size (`methods=batch`)", "", *run_lines(snapshot["run"])]
    rows = [
        [
            size,
            m,
            fmt(r["tokens_per_s"]),
            fmt(r["speedup"], ".3f", "×"),
            fmt(r["row_ms_per_token"], ".1f"),
            fmt(r["tau"]) if m != "plain" else "–",
            r.get("identical_to_plain", "–"),
        ]
        for size, methods in snapshot["batch"]["sizes"].items()
        for m, r in methods.items()
    ]
    lines += table(
        ["B", "method", "tok/s (all rows)", "× plain", "ms per token per row", "τ", "identical to plain"],
        rows,
    )
    crossover = ", ".join(
        f"`{m}` {snapshot['shapes'][m]}: {b}" for m, b in snapshot["batch"]["crossover"].items()
    )
    return [*lines, f"The batch size from which a tree is no faster than plain decoding: {crossover}.", ""]


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
    "ablation": ablation_section,
    "block": block_section,
    "sweep": sweep_section,
    "recipe": recipe_section,
    "lookahead": lookahead_section,
    "batch": batch_section,
    "train_speed": train_speed_section,
    "regen": regen_section,
}
