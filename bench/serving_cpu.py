"""CPU time per generated token outside the model, one request at a time: the API server
process, and the worker process minus its model steps (issue 20: on a small machine the
worker's threads use every core, so each millisecond another process or the worker's own
Python spends per token delays the next step).

Starts a local cluster (``bench/common.py`` ``launch_cluster``), sends ``--num-prompts``
ShareGPT prompts one at a time to ``/v1/completions`` (``ignore_eos``, greedy), streamed and
then not, and reads each process's CPU seconds from ``/proc`` around every request. In the
worker a probe (``serving_cpu_probe.py``, loaded by a ``sitecustomize`` put on the children's
``PYTHONPATH``; nothing in splitserve) sums the CPU spent inside ``ModelRunner.run`` (all threads: the model step) and the main
thread's CPU in the scheduler and in emitting token outputs; the rest of the worker's CPU is its loop
(polling, messages) and its other threads (ZeroMQ I/O, heartbeat, OpenMP threads spinning
between steps).

With ``--tree DIR`` (twice or more) one cluster runs each checkout's code and the requests
alternate between them, prompt by prompt (order flipped every prompt), so a machine whose speed
drifts (shared cores: CPU seconds per unit of work vary too) disturbs every tree alike.

    python bench/serving_cpu.py                          # colocated, bfloat16, 16 x 128 tokens
    python bench/serving_cpu.py --launch colocated:int8 --num-prompts 32
    python bench/serving_cpu.py --tree ../main --tree .  # before / after, alternating
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import httpx
from common import cpu_line, launch_cluster, load_prompts, resolve_bench_dtype, resolve_model
from serving_cpu_probe import FIELDS as PROBE_FIELDS
from serving_cpu_probe import FORMAT as PROBE

# Put on the cluster's PYTHONPATH: loads the probe into worker processes only.
SITECUSTOMIZE = """
import os, sys
if os.environ.get("SERVING_CPU_PROBE") and "worker" in sys.argv:
    sys.path.append({bench!r})
    import serving_cpu_probe
    serving_cpu_probe.install(os.environ["SERVING_CPU_PROBE"])
"""


def package_farm(tree: Path, folder: Path) -> Path:
    """A folder that, first on ``PYTHONPATH``, makes ``import splitserve`` load ``tree``'s code
    (links laid out as pyproject.toml's ``package-dir`` maps the packages), whatever checkout
    the interpreter was installed from."""
    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    pkg = folder / "splitserve"
    pkg.mkdir(parents=True)
    for name, sub in dirs["package-dir"].items():
        if name == "splitserve":
            for f in (tree / sub).resolve().glob("*.py"):
                (pkg / f.name).symlink_to(f)
        else:
            (pkg / name.split(".", 1)[1]).symlink_to((tree / sub).resolve())
    return folder


def proc_cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid``."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_pids(port: int) -> dict[str, int]:
    """The processes of the cluster serving on ``port`` (children of this process):
    ``{"api-server": pid, "colocated-0": pid, ...}``."""
    children = []  # (pid, argv, config) of this process's splitserve children
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            argv = (entry / "cmdline").read_bytes().split(b"\0") if stat else []
        except OSError:
            continue
        if argv and stat.rsplit(")", 1)[1].split()[1] == str(os.getpid()) and (
                b"--config-json" in argv):
            children.append((int(entry.name), argv,
                             json.loads(argv[argv.index(b"--config-json") + 1])))
    server = next((pid, c) for pid, argv, c in children
                  if b"api-server" in argv and c["server"]["port"] == port)
    found = {"api-server": server[0]}
    for pid, argv, config in children:  # its workers: those that reply to its inbox
        if b"worker" in argv and config["server_addr"] == server[1]["server"]["inbox"]:
            found[config["worker_id"]] = pid
    return found


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class Snapshot:
    """Every process's CPU seconds (and the workers' main threads' and probes') at one time;
    ``everyone``: the pids of every cluster, so that what the rest of the machine used shows."""

    def __init__(self, pids: dict[str, int], probe_dir: Path, everyone: list[int]) -> None:
        self.machine = machine_busy()
        self.ours = sum(proc_cpu(pid) for pid in everyone)
        self.cpu = {name: proc_cpu(pid) for name, pid in pids.items()}
        self.main = {name: proc_cpu(pid, pid) for name, pid in pids.items()}
        self.probe = {}
        for name, pid in pids.items():
            path = probe_dir / f"{pid}.probe"
            if path.exists():
                with path.open("rb") as f, mmap.mmap(f.fileno(), PROBE.size,
                                                     access=mmap.ACCESS_READ) as m:
                    self.probe[name] = PROBE.unpack_from(m)
        self.client = time.process_time()
        self.wall = time.perf_counter()

    def minus(self, before: Snapshot) -> dict[str, float]:
        """The seconds spent between ``before`` and this snapshot, by counter name."""
        out = {"client": self.client - before.client, "wall": self.wall - before.wall}
        out["others"] = (self.machine - before.machine) - (self.ours - before.ours) - out["client"]
        for name in self.cpu:
            out[name] = self.cpu[name] - before.cpu[name]
            out[f"{name}/main"] = self.main[name] - before.main[name]
            for i, field in enumerate(PROBE_FIELDS if name in self.probe else ()):
                out[f"{name}/{field}"] = self.probe[name][i] - before.probe[name][i]
        return out


def send(client: httpx.Client, url: str, ids: list[int], output_len: int, stream: bool) -> int:
    """One request; returns its completion tokens (from ``usage``)."""
    body = {"model": "default", "prompt": ids, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith('data: {"') and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


def report(label: str, spent: dict[str, float], tokens: int, names: list[str]) -> None:
    """Print CPU ms per generated token of every process, from summed ``Snapshot.minus``."""
    per = 1e3 / tokens
    others = spent["others"] / (spent["wall"] * (os.cpu_count() or 1))
    print(f"{label}: {tokens} tokens, {tokens / spent['wall']:.1f} tok/s while its requests ran"
          f" (other processes used {max(others, 0):.0%} of the machine meanwhile)")
    for name in names:
        total = spent[name] * per
        if f"{name}/steps" not in spent:
            print(f"  {name:<14} {total:7.3f} ms/token")
            continue
        run_p, run_t = spent[f"{name}/run_process"] * per, spent[f"{name}/run_thread"] * per
        sched, emit = spent[f"{name}/sched_thread"] * per, spent[f"{name}/emit_thread"] * per
        outside, main_outside = total - run_p, spent[f"{name}/main"] * per - run_t
        print(f"  {name:<14} {total:7.3f} ms/token, {spent[f'{name}/steps'] / tokens:.2f} "
              f"steps/token: model step (ModelRunner.run, all threads) {run_p:.3f}, "
              f"outside it {outside:.3f} =")
        print(f"  {'':<16} main thread {main_outside:.3f} (scheduler {sched:.3f}, emit "
              f"{emit:.3f}, loop and messages {main_outside - sched - emit:.3f}) + other threads"
              f" {outside - main_outside:.3f}")
    print(f"  {'client':<14} {spent['client'] * per:7.3f} ms/token (this script)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", default="colocated",
                   choices=[f"{m}{q}" for m in ("colocated", "disaggregated")
                            for q in ("", ":int8", ":int4")])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--tree", type=Path, action="append", default=[],
                   help="a checkout whose code a cluster runs (repeat: requests alternate)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--modes", nargs="+", choices=["stream", "full"], default=["stream", "full"])
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    dtype, _ = resolve_bench_dtype(args.dtype)
    prompts = load_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts,
                           args.max_input_len)
    mode, _, quantization = args.launch.partition(":")
    print(f"CPU: {cpu_line()}; {args.launch} {dtype}; "
          f"{args.num_prompts} prompts x {args.output_len} tokens, one at a time")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        probe_dir = Path(tmp)
        bench = str(Path(__file__).resolve().parent)
        (probe_dir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(bench=bench))
        clusters = []  # (label, url, pids)
        for i, tree in enumerate(args.tree or [None]):
            path = [tmp] if tree is None else [str(package_farm(tree, probe_dir / f"t{i}")), tmp]
            env = {"PYTHONPATH": os.pathsep.join(path + os.environ.get("PYTHONPATH", "").split(
                os.pathsep)).rstrip(os.pathsep), "SERVING_CPU_PROBE": tmp}
            url = stack.enter_context(launch_cluster(
                mode, model, dtype, quantization=quantization or "none", extra_env=env))
            label = f"cluster {i + 1}, " + (str(tree) if tree is not None else "this checkout")
            clusters.append((label, url, cluster_pids(int(url.rsplit(":", 1)[1]))))
        client = stack.enter_context(httpx.Client(timeout=600))
        everyone = [pid for _, _, pids in clusters for pid in pids.values()]
        for _, url, _ in clusters:
            for ids in prompts[:2]:  # warm-up
                send(client, url, ids, 8, True)
        for stream in (m == "stream" for m in args.modes):
            spent = {label: defaultdict(float) for label, _, _ in clusters}
            tokens = dict.fromkeys(spent, 0)
            for j, ids in enumerate(prompts):
                for label, url, pids in clusters if j % 2 == 0 else clusters[::-1]:
                    before = Snapshot(pids, probe_dir, everyone)
                    tokens[label] += send(client, url, ids, args.output_len, stream)
                    for key, value in Snapshot(pids, probe_dir, everyone).minus(before).items():
                        spent[label][key] += value
            for label, _, pids in clusters:
                report(f"{'streamed' if stream else 'not streamed'}, {label}", spent[label],
                       tokens[label], list(pids))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
