"""Which GPUs of this host Slurm has allocated to a job, whether or not the job's processes have opened them
yet. Pure, but for `identity` (a stat) and `read_gres_conf` (one small file).

`scontrol show job -d -o` prints, for each job with an allocation, a detail per group of nodes:
`Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:a100:2(IDX:0-1)` (older Slurm: `GRES_IDX=gpu(IDX:0)`). IDX is
the GPU's position among the node's GPUs in gres.conf (its `File=` lines, ranges expanded, in order), so
the device node at that position, compared by device number with the device node of each of this host's
GPUs, names the GPU. A job's text is partly its user's (its name, command, directories): a name that
imitates these words can only make more GPUs count as taken, never fewer (every `JobState=` word is read,
and the allocation counts unless all of them say the job holds nothing).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from gpu_mon.slurm.jobs import fields

# States in which a job holds no allocation (pending, or ended: Slurm keeps ended jobs for MinJobAge).
FREE_STATES = frozenset(
    (
        "PENDING",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "SPECIAL_EXIT",
        "REVOKED",
    )
)
_USER = re.compile(r"^(.*)\(\d+\)$")
_MAX_EXPANDED = 4096  # a range longer than this is not a list of nodes or GPUs (hostile or broken)


@dataclass(frozen=True)
class Allocated:
    """A job's GPUs on one node, by Slurm's index (None: Slurm said it has GPUs there, not which)."""

    job: int
    user: str
    node: str
    indices: Optional[Tuple[int, ...]]


def expand(text: str) -> List[str]:
    """Slurm's host list or device range: `n[01-03,7],m` -> n01 n02 n03 n7 m; `/dev/nvidia[0-1]` too.
    Raises ValueError on a malformed or huge range."""
    out: List[str] = []
    for item in _split_top(text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\]([^\[\]]*)", item)
        if not m:
            if "[" in item or "]" in item:
                raise ValueError(f"malformed range {item!r}")
            out.append(item)
            continue
        head, body, tail = m.groups()
        out += [f"{head}{n}{tail}" for n in _numbers(body, keep_width=True)]
        if len(out) > _MAX_EXPANDED:
            raise ValueError(f"range {item!r} too long")
    return [o for o in out if o]


def _split_top(text: str, brackets: str = "[]") -> List[str]:
    """Split at the commas outside `brackets` (an opening and a closing character)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == brackets[0]
        depth -= ch == brackets[1]
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _numbers(body: str, keep_width: bool = False) -> List[str]:
    """`0-2,5` -> 0 1 2 5 (zero-padded as written when keep_width)."""
    out: List[str] = []
    for part in body.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"malformed range {body!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first or last - first + len(out) > _MAX_EXPANDED:
            raise ValueError(f"range {body!r} too long or backwards")
        width = len(lo) if keep_width and lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(first, last + 1)]
    return out


def indices(text: str) -> Optional[Tuple[int, ...]]:
    """The GPU indices in a node's GRES words (`gpu:2(IDX:0-1)`, `gpu:t:1(IDX:3),mps:0`), () when they
    name no GPU, None when they name GPUs without readable indices (`gpu:1`, `IDX:N/A`)."""
    found: List[int] = []
    for entry in _split_top(text, "()"):
        name = entry.split("(", 1)[0].split(":")
        if name[0] != "gpu":
            continue
        m = re.fullmatch(r"[^(]*\(IDX:([^)]*)\)", entry)
        if m is None:
            if name[-1] != "0":  # (`gpu:0`: none)
                return None
            continue
        try:
            found += [int(n) for n in _numbers(m.group(1))]
        except ValueError:
            return None
    return tuple(sorted(set(found)))


def parse_allocations(text: str) -> Tuple[Allocated, ...]:
    """Every job's GPUs by node, from `scontrol show job -d -o` (one job a line; others are ignored)."""
    out: List[Allocated] = []
    for line in text.splitlines():
        words = line.split()
        head = fields(line)
        if not head.get("JobId", "").isdigit():
            continue
        states = [w.partition("=")[2] for w in words if w.startswith("JobState=")]
        if states and all(s in FREE_STATES for s in states):
            continue
        m = _USER.match(head.get("UserId", ""))
        user = m.group(1) if m else head.get("UserId", "?") or "?"
        job = int(head["JobId"])
        for nodes, gres in _details(words):
            try:
                names = expand(nodes)
            except ValueError:
                continue
            idx = indices(gres)
            out += [Allocated(job, user, n, idx) for n in names if idx != ()]
    return tuple(out)


def _details(words: Sequence[str]) -> List[Tuple[str, str]]:
    """(Nodes, GRES) of each detail: a `Nodes=` word and the GRES words that follow it before the next."""
    out: List[Tuple[str, str]] = []
    nodes: Optional[str] = None
    for w in words:
        key, eq, value = w.partition("=")
        if not eq:
            continue
        if key == "Nodes":
            nodes = value
        elif key in ("GRES", "GRES_IDX") and nodes is not None:
            out.append((nodes, value))
            nodes = None
    return out


# ---------------------------------------------------------------------------------------------- gres.conf


@dataclass(frozen=True)
class GresConf:
    """gres.conf's GPUs: the `File=` device nodes of each node named, in Slurm's index order; `anywhere`:
    those of lines that name no node (every node that reads the file has them)."""

    by_node: Mapping[str, Tuple[str, ...]]
    anywhere: Tuple[str, ...] = ()
    problem: str = ""  # why it cannot map indices (AutoDetect, GPUs without File=, unreadable)

    def files(self, node: str) -> Tuple[str, ...]:
        """The GPU device nodes of `node`, by index."""
        return (*self.anywhere, *self.by_node.get(node, ()))


def parse_gres_conf(text: str) -> GresConf:
    """gres.conf text -> its GPUs' device nodes by node (keys are case-insensitive; `#` starts a comment)."""
    by_node: Dict[str, List[str]] = {}
    anywhere: List[str] = []
    problem = ""
    for number, raw in enumerate(text.splitlines(), 1):
        words = {}
        for w in raw.split("#", 1)[0].split():
            k, eq, v = w.partition("=")
            if eq:
                words[k.lower()] = v
        if words.get("autodetect", "off").lower() not in ("off", "") and "name" not in words:
            problem = problem or f"line {number}: AutoDetect={words['autodetect']} (the order is Slurm's own)"
        if words.get("name", "").lower() != "gpu":
            continue
        try:
            files = expand(words["file"]) if "file" in words else []
            nodes = expand(words["nodename"]) if "nodename" in words else None
        except ValueError as err:
            problem = problem or f"line {number}: {err}"
            continue
        if not files:
            problem = problem or f"line {number}: a GPU without File="
        if nodes is None:
            anywhere += files
        for n in nodes or ():
            by_node.setdefault(n, []).extend(files)
    return GresConf({n: tuple(f) for n, f in by_node.items()}, tuple(anywhere), problem)


def gres_conf_path(environ: Mapping[str, str]) -> str:
    """Where Slurm keeps gres.conf: beside slurm.conf (SLURM_CONF, else /etc/slurm)."""
    conf = environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    return os.path.join(os.path.dirname(conf), "gres.conf")


def read_gres_conf(path: str) -> GresConf:
    """The file parsed; its problem says when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_gres_conf(f.read(1 << 20))
    except OSError as err:
        return GresConf({}, (), f"cannot read {path}: {err.strerror or err}")


def identity(path: str) -> Optional[Tuple[int, ...]]:
    """What names a device node: a char device's numbers (st_rdev), a simulator's stand-in file's
    (st_dev, st_ino); None when it cannot be looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_rdev,) if stat.S_ISCHR(st.st_mode) else (st.st_dev, st.st_ino)


def this_node(node_name: Optional[str], host: str, seen: Iterable[str]) -> Tuple[Set[str], bool]:
    """(This host's Slurm node names, whether gres.conf may add one: gpu_of's `guess`): `node_name` alone
    when set ([slurm] node_name); else the short host name and each SLURMD_NODENAME seen in a job here."""
    if node_name:
        return {node_name}, False
    return {host, *(n for n in seen if n)}, True


def gpu_of(
    alloc_node: str,
    index: int,
    conf: GresConf,
    here: Set[str],
    gpu_ids: Mapping[Tuple[int, ...], str],
    ident: Callable[[str], Optional[Tuple[int, ...]]] = identity,
    guess: bool = True,
) -> Optional[str]:
    """The UUID of this host's GPU that is `index` on Slurm's node `alloc_node`, or None (another host's,
    or not known). The node is this host when it is one of `here` (its names), or (`guess`) when gres.conf
    gives it a device node that no other node names (several slurmd on one host)."""
    files = conf.files(alloc_node)
    if index >= len(files):
        return None
    path = files[index]
    if alloc_node not in here:
        if not guess or alloc_node not in conf.by_node or path in conf.anywhere:
            return None
        if any(path in f for n, f in conf.by_node.items() if n != alloc_node):
            return None
    key = ident(path)
    return gpu_ids.get(key) if key is not None else None


def mapped(
    allocs: Iterable[Allocated],
    conf: GresConf,
    here: Set[str],
    gpu_ids: Mapping[Tuple[int, ...], str],
    ident: Callable[[str], Optional[Tuple[int, ...]]] = identity,
    guess: bool = True,
) -> Tuple[Dict[str, Tuple[int, str]], List[str]]:
    """({UUID: (job, user)} of this host's GPUs that Slurm allocated, [what could not be mapped]): an
    allocation on one of this host's names whose GPU cannot be told is a problem; one on a node of
    another host is not. `guess`: as gpu_of's."""
    out: Dict[str, Tuple[int, str]] = {}
    problems: List[str] = []
    for a in allocs:
        ours = a.node in here
        if a.indices is None:
            if ours:
                problems.append(f"job {a.job} on {a.node}: Slurm does not say which GPUs")
            continue
        for i in a.indices:
            uuid = gpu_of(a.node, i, conf, here, gpu_ids, ident, guess)
            if uuid is not None:
                out.setdefault(uuid, (a.job, a.user))
            elif ours:
                why = conf.problem or f"gres.conf gives {a.node} no GPU {i} that is a GPU of this host"
                problems.append(f"job {a.job} on {a.node}, GPU index {i}: {why}")
    return out, problems
