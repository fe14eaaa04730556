#!/usr/bin/env python3
"""Print the requirements of pyproject.toml, one a line: the base dependencies, plus those of
the extras named. docker/Dockerfile installs them in a layer of their own, before the kvserve
wheel, so that a change to kvserve's sources does not reinstall onnxruntime or torch.

    python3 docker/requirements.py pyproject.toml [EXTRA...]
"""
import sys
import tomllib

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in sys.argv[2:]:
        reqs += project["optional-dependencies"][extra]
    print("\n".join(reqs))
