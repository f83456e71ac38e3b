"""A bad-input and crash sweep of every specdraft command, as a user would try it (issue #62).

Runs each probe of scripts/probe_catalogue.py as a real process of its console script, on the tiny
target, in its own temporary directory, one after another, and judges its outcome:

  clear              what the probe expects: refused in one line naming the key or file, or accepted
                     with its post-check passing
  traceback          a Python traceback on stderr
  hydra-wrapped      Hydra's own error ("Set the environment variable HYDRA_FULL_ERROR" …)
  unclear            exit 2 and one line, but without the key or file the user must fix
  multi-line         exit 2 without the one ``<command>: error: …`` line last on stderr
  silently-accepted  exit 0 where the input must be refused
  wrongly-refused    refused where it must run (a re-run a failed run blocks, …)
  wrong-result/lost  exit 0 but the post-check failed (files outside outputs, a user file deleted,
                     records twice, two runs mixed, a checkpoint that ran code)
  wrong-exit         another exit code without a traceback
  timeout            still running after the probe's timeout
  skipped            the machine cannot make the probe's condition (chmod as root)

The shared fixtures (a tiny trained run, a train and a held-out cache, an export) are made once.
  python scripts/probe_user_errors.py --out /tmp/sweep.json [--only train-]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_catalogue import PROBES
from probe_setups import Probe

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TAIL_CHARS = 2000
FIXTURE_TIMEOUT_S = 300
TRACEBACK = "Traceback (most recent call last)"
HYDRA_MARKS = ("HYDRA_FULL_ERROR", "Error executing job with overrides", "Error merging override")
LOST_MARKS = ("lost:", "a checkpoint ran code")
DROPPED_ENV = ("HYDRA_FULL_ERROR", "SPECDRAFT_DEBUG", "SPECDRAFT_LOG_DIR")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def argv(probe_command: str, args: tuple[str, ...], t: Path, fx: dict) -> list[str]:
    values = {"t": str(t), "repo": str(REPO), **fx}
    filled = []
    for arg in args:
        for key, value in values.items():
            arg = arg.replace(f"<{key}>", str(value))
        filled.append(arg)
    return [str(BIN / f"specdraft-{probe_command}"), *filled]


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,  # a timeout ends its stages too
    )


def finish(process: subprocess.Popen, timeout: float, started: float) -> dict:
    try:
        out, err = process.communicate(timeout=max(timeout - (time.monotonic() - started), 1))
        rc = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        rc = None
    return {
        "rc": rc,
        "seconds": round(time.monotonic() - started, 1),
        "stdout_tail": out[-TAIL_CHARS:],
        "stderr_tail": err[-TAIL_CHARS:],
    }


def run(command: list[str], cwd: Path, timeout: float) -> dict:
    return finish(start(command, cwd), timeout, time.monotonic())


def error_line(stderr: str, command: str) -> str | None:
    """The one ``<command>: error: …`` line, when it is the last line of stderr and alone."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    prefix = f"specdraft-{command}: error: "
    errors = [line for line in lines if line.startswith(prefix)]
    return errors[0] if len(errors) == 1 and lines[-1] == errors[0] else None


def process_fault(result: dict) -> str | None:
    """The verdict every probe shares, whatever its expected outcome: a timeout, a traceback or
    Hydra's own multi-line error (None: none of them)."""
    err = result["stderr_tail"]
    if result["rc"] is None:
        return "timeout"
    if TRACEBACK in err:
        return "traceback"
    if any(mark in err for mark in HYDRA_MARKS):
        return "hydra-wrapped"
    return None


def judge_refusal(result: dict, command: str, fragments: tuple[str, ...]) -> str:
    """The verdict of one process that should be refused."""
    err = result["stderr_tail"]
    if fault := process_fault(result):
        return fault
    if result["rc"] == 0:
        return "silently-accepted"
    if result["rc"] != 2:
        return "wrong-exit"
    line = error_line(err, command)
    if line is None:
        return "multi-line"
    message = line.split(": error: ", 1)[1]  # "specdraft-export: …" must not name "exp" for it
    return "clear" if all(f in message for f in fragments) else "unclear"


def judge_acceptance(result: dict, failure: str | None) -> str:
    """The verdict of one process that should succeed (``failure``: its post-check's, if any)."""
    if fault := process_fault(result):
        return fault
    if result["rc"] == 2:
        return "wrongly-refused"
    if result["rc"] != 0:
        return "wrong-exit"
    return "clear" if failure is None else post_verdict(failure)


def post_verdict(failure: str) -> str:
    return "lost" if any(mark in failure for mark in LOST_MARKS) else "wrong-result"


def files(root: Path) -> set[str]:
    return {str((Path(d) / f).relative_to(root)) for d, _, names in os.walk(root) for f in names}


def make_unwritable(path: Path, needs: str) -> str | None:
    """chmod 555 or chattr +i ``path``; the reason it cannot be done here, if so."""
    if needs == "root-chmod":
        if os.geteuid() == 0:
            return "running as root: chmod does not stop root from writing"
        path.chmod(0o555)
        return None
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"chattr +i failed: {done.stderr.strip()[:200]}"


def release(path: Path) -> None:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    if path.exists():
        path.chmod(0o755)


def run_probe(probe: Probe, fx: dict, scratch: Path) -> dict:
    t = Path(tempfile.mkdtemp(prefix="p-", dir=scratch))  # no word of a fragment in its path
    record = {
        "id": probe.id,
        "command": f"specdraft-{probe.command}",
        "expect": probe.expect,
        "kind": probe.kind,
        "fragments": list(probe.fragments),
    }
    locked = t / probe.setup.locked if hasattr(probe.setup, "locked") else None
    try:
        if probe.setup:
            probe.setup(t, fx)
        shutil.copytree(t, t.parent / f"{t.name}.before", symlinks=True)
        for args in probe.before:
            done = run(argv(probe.command, args, t, fx), t, probe.timeout)
            before = {"rc": done["rc"], "stderr_tail": done["stderr_tail"][-300:]}
            record.setdefault("before", []).append(before)
        if probe.between:
            probe.between(t, fx)
        if probe.needs and locked is not None:
            reason = make_unwritable(locked, probe.needs)
            if reason:
                return {**record, "verdict": "skipped", "reason": reason, "rc": None, "seconds": 0}
        existing = files(t)
        command = argv(probe.command, probe.args, t, fx)
        record["argv"] = command[1:]
        if probe.expect == "race":
            return {**record, **race(probe, command, t, fx, existing)}
        result = run(command, t, probe.timeout)
        failure = None
        if probe.check and result["rc"] is not None:
            failure = probe.check(t, fx, sorted(files(t) - existing))
        if probe.expect == "refuse":
            verdict = judge_refusal(result, probe.command, probe.fragments)
            if failure and verdict in ("clear", "unclear", "silently-accepted"):
                verdict = post_verdict(failure)  # what was written or lost says more
        else:
            verdict = judge_acceptance(result, failure)
        return {**record, **result, "post_check": failure, "verdict": verdict}
    except Exception as error:  # a probe's own setup failing must not stop the sweep
        return {**record, "verdict": "probe-error", "reason": f"{type(error).__name__}: {error}"}
    finally:
        if locked is not None:
            release(locked)
        shutil.rmtree(t, ignore_errors=True)
        shutil.rmtree(t.parent / f"{t.name}.before", ignore_errors=True)


def race(probe: Probe, command: list[str], t: Path, fx: dict, existing: set[str]) -> dict:
    """Two processes at once on one directory: at most one runs, the other is refused in one line,
    and nothing is mixed."""
    started = time.monotonic()
    processes = [start(command, t), start([*command, *probe.second], t)]
    results = [finish(p, probe.timeout, started) for p in processes]
    failure = probe.check(t, fx, sorted(files(t) - existing)) if probe.check else None
    rcs = [r["rc"] for r in results]
    errs = "".join(r["stderr_tail"] for r in results)
    if None in rcs:
        verdict = "timeout"
    elif TRACEBACK in errs:
        verdict = "traceback"
    elif failure:
        verdict = post_verdict(failure)
    elif rcs == [0, 0]:
        verdict = "clear"  # both ran and nothing was mixed (serialised)
    elif sorted(rcs) == [0, 2]:
        verdict = judge_refusal(results[rcs.index(2)], probe.command, probe.fragments)
    else:
        verdict = "wrongly-refused" if rcs == [2, 2] else "wrong-exit"
    return {
        "rc": rcs,
        "seconds": round(time.monotonic() - started, 1),
        "post_check": failure,
        "stderr_tail": [r["stderr_tail"] for r in results],
        "verdict": verdict,
    }


def make_fixtures(root: Path) -> dict:
    """A tiny trained run, a train and a held-out cache, and a native export of the run."""
    steps = [
        ("train", ("experiment=eagle", "debug=smoke")),
        ("cache", ("target=tiny_random", "data=tiny", "limit=10", "progress=false", f"out_dir={root}/cache")),
        (
            "cache",
            (
                "target=tiny_random",
                "data=tiny",
                "split=heldout",
                "limit=6",
                "progress=false",
                f"out_dir={root}/heldout",
            ),
        ),
    ]
    run_dir = root / "outputs" / "train" / "smoke-eagle-eagle"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    steps.append(("export", ("target=tiny_random", f"checkpoint={ckpt}", f"out={root}/export")))
    for command, args in steps:
        done = run([str(BIN / f"specdraft-{command}"), *args], root, FIXTURE_TIMEOUT_S)
        if done["rc"] != 0:
            sys.exit(f"fixture specdraft-{command} failed: {done['stderr_tail'][-1500:]}")
    return {
        "run": str(run_dir),
        "ckpt": str(ckpt),
        "cache": str(root / "cache"),
        "heldout": str(root / "heldout"),
        "export": str(root / "export"),
    }


def machine() -> dict:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    names = (line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name"))
    model = next(names, "")
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "commit": commit,
        "dirty": bool(dirty),
        "euid": os.geteuid(),
    }


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(partial, path)


def table(records: list[dict]) -> str:
    rows = [f"{'probe':40} {'verdict':18} {'rc':>6} {'s':>6}  stderr (last line)"]
    for r in records:
        tail = r.get("stderr_tail", "")
        tail = tail[-1] if isinstance(tail, list) else tail
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), r.get("reason", ""))
        rc, seconds = str(r.get("rc")), r.get("seconds", 0)
        rows.append(f"{r['id']:40} {r['verdict']:18} {rc:>6} {seconds:>6}  {last[:110]}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write (atomically)")
    parser.add_argument("--only", default=None, help="the probes whose id contains this (a,b: either)")
    args = parser.parse_args()
    wanted = args.only.split(",") if args.only else None
    probes = [p for p in PROBES if wanted is None or any(w in p.id for w in wanted)]
    if not probes:
        parser.error(f"no probe id contains {args.only!r}")
    started = time.monotonic()
    payload = {"machine": machine(), "probes": [], "counts": {}}
    with tempfile.TemporaryDirectory(prefix="sd-sweep-") as scratch:
        root = Path(scratch)
        (root / "fixtures").mkdir()
        fx = make_fixtures(root / "fixtures")
        payload["fixture_seconds"] = round(time.monotonic() - started, 1)
        for n, probe in enumerate(probes, start=1):
            record = run_probe(probe, fx, root)
            payload["probes"].append(record)
            payload["counts"] = dict(Counter(r["verdict"] for r in payload["probes"]).most_common())
            payload["wall_s"] = round(time.monotonic() - started, 1)
            write_json_atomic(args.out, payload)  # a partial sweep is kept if this one is stopped
            print(
                f"[{n}/{len(probes)}] {probe.id}: {record['verdict']} ({record.get('seconds', 0)} s)",
                flush=True,
            )
    print(table(payload["probes"]))
    print(f"counts: {payload['counts']}; {len(probes)} probes in {payload['wall_s']} s")


if __name__ == "__main__":
    main()
