# On Colab only: fetch the course, or update the copy a restarted runtime kept, and install it. Elsewhere this
# cell does nothing unless INFOPT_LAB_DIR names where to put the course. INFOPT_LAB_REPO overrides the
# repository (by default the one the installed package names), INFOPT_LAB_PIP the install command.
import importlib.metadata
import os
import shlex
import subprocess
import sys

repo = os.environ.get("INFOPT_LAB_DIR") or ("/content/infopt-lab" if "google.colab" in sys.modules else None)
if repo:
    try:   # pyproject.toml's [project.urls] Repository, once the course is installed
        urls = importlib.metadata.metadata("infopt-lab").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        urls = []
    url = os.environ.get("INFOPT_LAB_REPO") or next(
        (u.split(",", 1)[1].strip() for u in urls if u.startswith("Repository,")),
        "https://github.com/infopt-lab/infopt-lab.git")
    if os.path.isdir(os.path.join(repo, ".git")):   # run again, or after a restart: update, never clone twice
        subprocess.run(["git", "-C", repo, "pull", "-q", "--ff-only"], check=True)
    else:
        subprocess.run(["git", "clone", "-q", "--depth", "1", url, repo], check=True)
    pip = shlex.split(os.environ.get("INFOPT_LAB_PIP", "")) or [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-e", repo], check=True)
    if repo not in sys.path:
        sys.path.insert(0, repo)   # editable installs are picked up at start-up; this kernel is already running
