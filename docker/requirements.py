"""Print the dependencies of pyproject.toml, one per line, for ``pip install -r``: the image
installs them in a layer of their own before copying the code (so a code change does not
reinstall them) and leaves out those it replaces with other builds (``--without NAME``).

    python docker/requirements.py [--without NAME ...] > /tmp/requirements.txt
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path


def requirements(pyproject: Path, without: list[str]) -> list[str]:
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    skip = {name.lower() for name in without}
    return [d for d in deps if re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0].lower() not in skip]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--without", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, args.without)))


if __name__ == "__main__":
    main()
