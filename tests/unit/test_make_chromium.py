"""`make test` on a machine without Chromium (the console's browser tests need the system's):
root with apt-get installs it as CI's machine would; anyone else is stopped before the install
and the suite with one line saying how. Run against fakes of ``id``, ``apt-get`` and
``python3`` on an otherwise empty PATH, so nothing here installs or uninstalls anything."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

#: apt-get's stand-in: logs its arguments; `install` makes the Chromium the check looks for
#: (an executable file) unless told to fail as a failed download would
FAKE_APT_GET = """#!{python}
import os, pathlib, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    frontend = os.environ.get("DEBIAN_FRONTEND", "")
    log.write(f"apt-get {' '.join(sys.argv[1:])} DEBIAN_FRONTEND={frontend}\\n")
if "install" in sys.argv:
    if os.environ.get("FAKE_APT_FAILS"):
        print("E: Unable to locate package chromium", file=sys.stderr)
        sys.exit(100)
    browser = pathlib.Path(os.environ["FAKE_CHROMIUM"])
    browser.write_text("#!/bin/sh\\n")
    browser.chmod(0o755)
"""


class Machine:
    """A fresh machine as make sees it: PATH holds only the fakes given."""

    def __init__(self, tmp: Path, *, uid: int, apt: bool) -> None:
        self.tmp = tmp
        self.chromium = tmp / "chromium"
        self.log = tmp / "log"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        self.log.write_text("")
        fakes = {
            "id": f"#!/bin/sh\necho {uid}\n",
            # the venv's Python, had the install begun
            "python3": '#!/bin/sh\necho "python3 $*" >> "$FAKE_LOG"\nexit 1\n',
        }
        if apt:
            fakes["apt-get"] = FAKE_APT_GET.replace("{python}", sys.executable)
        for name, text in fakes.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.env = {
            "PATH": str(bin_dir),
            "HOME": str(tmp),  # no pyenv Python found under it
            "FAKE_LOG": str(self.log),
            "FAKE_CHROMIUM": str(self.chromium),
        }

    def make(self, target: str, **env: str) -> subprocess.CompletedProcess[str]:
        assert MAKE is not None, "no make on PATH (the README's prerequisite)"
        # Debian's path is this machine's stand-in (and SHOAL_CHROMIUM's default), so the real
        # /usr/bin/chromium is never looked at
        stand_in = f"DEBIAN_CHROMIUM={self.chromium}"
        return subprocess.run(
            [MAKE, "-s", "-C", str(ROOT), target, f"VENV={self.tmp / 'venv'}", stand_in],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ran(self) -> list[str]:
        return self.log.read_text().splitlines()


def said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr's lines but make's own trailer ("make: *** [Makefile:N: chromium] Error 1")."""
    return [line for line in done.stderr.splitlines() if not line.startswith("make: *** ")]


def test_without_chromium_a_user_who_cannot_install_it_is_stopped_before_anything_runs(
    tmp_path: Path,
) -> None:
    # Given a machine without Chromium, and a user who is not root
    machine = Machine(tmp_path, uid=1000, apt=True)
    # When they run the README's test command
    done = machine.make("test")
    # Then make stops at once with one line saying how, before the install and the suite
    assert done.returncode != 0
    [line] = said(done)
    assert line.startswith(f"make: no Chromium at {machine.chromium} for the console's browser")
    assert "apt-get install chromium" in line and "SHOAL_CHROMIUM=" in line
    assert done.stdout == ""
    assert machine.ran() == []
    assert not (tmp_path / "venv").exists()


def test_root_with_apt_get_gets_debians_chromium_then_the_install_goes_on(tmp_path: Path) -> None:
    # Given a machine without Chromium, and root with apt-get (as CI's machine)
    machine = Machine(tmp_path, uid=0, apt=True)
    # When the README's test command runs
    done = machine.make("test")
    # Then apt-get installs Debian's package non-interactively, as .ci/run did, and only then
    # does the install begin (here the fake Python ends it)
    assert machine.ran()[:2] == [
        "apt-get update -qq DEBIAN_FRONTEND=",
        "apt-get install -y -qq chromium DEBIAN_FRONTEND=noninteractive",
    ]
    assert machine.ran()[2].startswith("python3 -m venv")
    assert machine.chromium.exists()
    assert "installing Debian's chromium" in done.stdout


def test_a_failed_apt_get_install_stops_with_the_line(tmp_path: Path) -> None:
    # Given root with apt-get, whose install of chromium fails
    machine = Machine(tmp_path, uid=0, apt=True)
    # When the check runs
    done = machine.make("chromium", FAKE_APT_FAILS="1")
    # Then it fails with apt-get's reason and the line saying how
    assert done.returncode != 0
    assert "Unable to locate package chromium" in done.stderr
    assert said(done)[-1].startswith(f"make: no Chromium at {machine.chromium}")


def test_root_without_apt_get_is_told_how_and_nothing_is_tried(tmp_path: Path) -> None:
    # Given root on a machine without apt-get (not Debian's family)
    machine = Machine(tmp_path, uid=0, apt=False)
    # When the check runs
    done = machine.make("chromium")
    # Then it stops with the line, having tried no install
    assert done.returncode != 0
    [line] = said(done)
    assert line.startswith(f"make: no Chromium at {machine.chromium}")
    assert machine.ran() == []


def test_another_chromium_named_but_missing_is_not_replaced_by_debians(tmp_path: Path) -> None:
    # Given root with apt-get, and SHOAL_CHROMIUM naming a Chromium of its own that is missing
    machine = Machine(tmp_path, uid=0, apt=True)
    elsewhere = tmp_path / "opt-chromium"
    # When the check runs
    done = machine.make("chromium", SHOAL_CHROMIUM=str(elsewhere))
    # Then nothing is installed (Debian's package would not be there) and the line says how
    assert done.returncode != 0
    [line] = said(done)
    assert line.startswith(f"make: no Chromium at {elsewhere}")
    assert machine.ran() == []


def test_a_chromium_already_there_installs_nothing(tmp_path: Path) -> None:
    # Given root with apt-get, and a Chromium where Debian puts it
    machine = Machine(tmp_path, uid=0, apt=True)
    machine.chromium.write_text("#!/bin/sh\n")
    machine.chromium.chmod(0o755)
    # When the check runs
    done = machine.make("chromium")
    # Then it passes quietly and apt-get is never called
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert machine.ran() == []
