"""Overlays rendered the way an operator sets them up: components added and images set with
`kustomize edit` (emulated here: kubectl embeds kustomize's build, not its `edit`) in a temporary
copy of deploy/k8s, then built with `kubectl kustomize`. Each distinct stack is rendered once per
session; the README's walkthroughs are replayed through the same edits.
"""

from __future__ import annotations

import atexit
import functools
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import deploy_helpers as dh

Objs = tuple[dict[str, Any], ...]


def add_components(kustomization: Path, paths: Iterable[str]) -> None:
    """What `kustomize edit add component PATH...` does: append each path not yet listed."""
    kust = yaml.safe_load(kustomization.read_text())
    listed = list(kust.get("components") or [])
    kust["components"] = listed + [p for p in paths if p not in listed]
    kustomization.write_text(yaml.safe_dump(kust, sort_keys=False))


def split_image_ref(ref: str) -> dict[str, str]:
    """REPO[:TAG][@DIGEST] as kustomize's `images:` fields (newName, newTag, digest)."""
    out: dict[str, str] = {}
    name, _, digest = ref.partition("@")
    if digest:
        out["digest"] = digest
    repo, colon, tag = name.rpartition(":")
    if colon and "/" not in tag:
        out.update(newName=repo, newTag=tag)
    else:
        out["newName"] = name
    return out


def set_image(kustomization: Path, name: str, ref: str) -> None:
    """What `kustomize edit set image NAME=REF` does: one `images:` entry for NAME, replaced or added."""
    kust = yaml.safe_load(kustomization.read_text())
    images = [i for i in kust.get("images") or [] if i["name"] != name]
    kust["images"] = [*images, {"name": name, **split_image_ref(ref)}]
    kustomization.write_text(yaml.safe_dump(kust, sort_keys=False))


@dataclass(frozen=True)
class Stack:
    """Edits to make in deploy/k8s before rendering `overlay`: per kustomization directory
    (relative to deploy/k8s), the components to add and the images to set."""

    overlay: str
    components: tuple[tuple[str, tuple[str, ...]], ...] = ()
    images: tuple[tuple[str, str, str], ...] = ()  # (directory, name, ref)


def stack(
    overlay: str,
    gpu: Iterable[str] = (dh.TEST_STORAGE,),
    own: Iterable[str] = (),
) -> Stack:
    """`overlay` with components (by name, under components/) added to the gpu overlay and to itself."""
    comps = [("overlays/gpu", tuple(f"../../components/{c}" for c in gpu))]
    if overlay != "gpu" and own:
        comps.append((f"overlays/{overlay}", tuple(f"../../components/{c}" for c in own)))
    return Stack(overlay, tuple(comps))


@functools.cache
def render_stack(s: Stack) -> Objs:
    tmp = Path(tempfile.mkdtemp(prefix="ringtrain-stack-"))
    atexit.register(shutil.rmtree, tmp, True)
    tree = tmp / "k8s"
    shutil.copytree(dh.K8S, tree)
    for where, paths in s.components:
        add_components(tree / where / "kustomization.yaml", paths)
    for where, name, ref in s.images:
        set_image(tree / where / "kustomization.yaml", name, ref)
    return dh.render(str(tree / "overlays" / s.overlay))


def render(overlay: str, gpu: Iterable[str] = (dh.TEST_STORAGE,), own: Iterable[str] = ()) -> Objs:
    dh.need_kubectl()
    return render_stack(stack(overlay, tuple(gpu), tuple(own)))


# --- the README's walkthroughs, replayed ------------------------------------------------------------------------


@dataclass
class Walkthrough:
    """The deploy edits and the apply of one README section, read from its bash blocks."""

    components: dict[str, list[str]] = field(default_factory=dict)
    images: list[tuple[str, str, str]] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # overlays named by `kubectl apply -k`

    def stack(self) -> Stack:
        comps = tuple((d, tuple(p)) for d, p in self.components.items())
        assert self.applied, "the walkthrough applies no overlay"
        return Stack(self.applied[-1], comps, tuple(self.images))


def section(markdown: str, heading: str) -> str:
    """The text under `heading` (a line of #s and a title) up to the next heading of its level or
    above; lines inside code blocks (shell comments) are no headings."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines(keepends=True)
    start = lines.index(heading + "\n") + 1
    fenced = False
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", lines[i]):
            return "".join(lines[start:i])
    return "".join(lines[start:])


def bash_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def expand(word: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} from the variables set so far (others left as written)."""
    return re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda v: env.get(v.group(1), v.group(0)), word)


def replay(text: str) -> Walkthrough:
    """`cd`, `kustomize edit add component`, `kustomize edit set image`, shell variables set to a
    word and `kubectl apply -k deploy/k8s/overlays/X`, in order; everything else is skipped. A
    line in parentheses is a subshell: its `cd` ends with it."""
    w = Walkthrough()
    cwd = Path(".")
    env: dict[str, str] = {}
    for line in bash_lines(text):
        outer = cwd
        subshell = line.startswith("(") and line.endswith(")")
        if subshell:
            line = line[1:-1]
        for command in re.split(r"\s*&&\s*", line):
            m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(\S+)", command)
            if m:
                env[m.group(1)] = expand(m.group(2).strip('"'), env)
                continue
            try:
                words = [expand(word, env) for word in shlex.split(command)]
            except ValueError:  # a quote closed on another command of the line: not ours
                continue
            if not words:
                continue
            if words[0] == "cd":
                cwd = Path(words[1]) if words[1].startswith("deploy/") else cwd / words[1]
            elif words[:4] == ["kustomize", "edit", "add", "component"]:
                where = _k8s_relative(cwd)
                w.components.setdefault(where, []).extend(words[4:])
            elif words[:4] == ["kustomize", "edit", "set", "image"]:
                for spec in words[4:]:
                    name, _, ref = spec.partition("=")
                    w.images.append((_k8s_relative(cwd), name, ref))
            elif words[:2] == ["kubectl", "apply"] and "-k" in words:
                target = words[words.index("-k") + 1]
                m2 = re.fullmatch(r"deploy/k8s/overlays/([\w-]+)", target)
                if m2:
                    w.applied.append(m2.group(1))
        if subshell:
            cwd = outer
    return w


def _k8s_relative(cwd: Path) -> str:
    parts = cwd.parts
    assert parts[:2] == ("deploy", "k8s"), f"kustomize edit outside deploy/k8s: {cwd}"
    return str(Path(*parts[2:]))
