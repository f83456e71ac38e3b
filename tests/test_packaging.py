"""One import package, `specdraft`, installed from a wheel. (What each of its packages may
import: tests/test_layering.py.)"""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_specdraft_and_imports_outside_the_checkout(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("specdraft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"specdraft", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "specdraft/conf/target/smollm2_135m.yaml" in names
    assert not any(name.startswith(("specdraft/tests", "specdraft/scripts")) for name in names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    code = (
        "import specdraft.system, specdraft.heads, specdraft.data, specdraft.train, specdraft.eval, "
        "specdraft.recipes, specdraft.data.prepare; "
        "from hydra import compose, initialize_config_module; "
        "initialize_config_module(config_module='specdraft.conf', version_base='1.3').__enter__(); "
        "compose(config_name='prepare', overrides=['target=tiny_random']); "
        "print(specdraft.data.__file__)"
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=outside,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith(str(site))
