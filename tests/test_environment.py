"""The conda route (environment.yml) installs what the .venv route (pyproject + Makefile) does."""
import re
import tomllib

import yaml

from notebook_tools import ROOT


def test_environment_yml_matches_pyproject_and_makefile():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert project["requires-python"] == ">=" + python.split("=")[1]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert torch_pin in pip
    extras = sorted(project["optional-dependencies"])
    assert f"-e .[{','.join(extras)}]" in pip, "environment.yml must install every extra of pyproject.toml"
    makefile = (ROOT / "Makefile").read_text()
    assert f"'.[{','.join(extras)}]'" in makefile and torch_pin in makefile
    smollm = re.search(r"SMOLLM\s*:=\s*(\S+)", makefile).group(1)
    assert smollm in (ROOT / "environment.yml").read_text()
    assert smollm in (ROOT / "README.md").read_text()
