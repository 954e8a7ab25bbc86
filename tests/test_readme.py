"""The README's quickstart runs as written (in a subprocess, so it sets up its own devices)."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs(tmp_path):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Plan 'dp_tp'" in proc.stdout
    assert "all-reduce" in proc.stdout


def test_readme_names_the_two_setup_commands():
    text = README.read_text()
    assert "pip install -e . && hulkjax demo" in text
    assert 'pip install -e ".[dev,notebooks]" && python3 -m pytest -n 2 --dist loadfile' in text
