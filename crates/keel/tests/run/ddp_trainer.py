#!/usr/bin/env python3
"""A real trainer for `keel run` tests: a small model trained with
PyTorch DDP over gloo on CPU, one worker per node, launched by torchrun
(under srun, one torchrun agent per node), checkpointed with
torch.distributed.checkpoint (DCP) into keel's layout: step_<N>/ under
$KEEL_CKPT_DIR, committed by DCP's own `.metadata`.

Deterministic: fixed seeds, each step's data a function of the step
alone, in float64. The global batch (DDP_BATCH rows) is split over the
ranks and each rank's loss is scaled by world/batch, so DDP's gradient
average is the whole batch's mean gradient whatever the world size: a run
resumed on fewer nodes follows the uninterrupted one up to rounding.

Checkpoint requests: rank 0 reads $KEEL_CKPT_REQUEST after every step and
broadcasts whether its content changed; then every rank saves at the same
step. No signal is needed (torchrun's agent dies of SIGUSR1 and turns
SIGTERM into a shutdown).

Environment:
  DDP_STEPS      train until this step, then exit 0 (default 30)
  DDP_EVERY      checkpoint interval in steps (default 10)
  DDP_STEP_SECS  seconds of "compute" per step (default 0.2)
  DDP_BATCH      global batch rows (default 12)
  DDP_LOG        rank 0 appends "fresh" / "resumed N" / "trained N" [time]
  DDP_RESULT     rank 0 writes the final parameters here (JSON, float.hex)
  DDP_MODE       ok | crash-at:N | hang-at:N
  DDP_FAULT_NODE with crash-at/hang-at: only on this node (SLURMD_NODENAME)
  DDP_FAULT_FILE with crash-at/hang-at: only while this file exists
  DDP_RESUME_LATEST  1: without keel run, resume from the newest committed
                 step_<N> under KEEL_CKPT_DIR
  DDP_CKPT_SECS  seconds a save takes before DCP writes (a slow checkpoint)
  DDP_ON_SIGNAL  1: as many trainers do, SIGUSR1 asks for a checkpoint
                 and SIGTERM for a checkpoint and a clean exit, taken at
                 the next step (default: the signals' default actions)
"""
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(os.environ.get("DDP_STEPS", "30"))
every = int(os.environ.get("DDP_EVERY", "10"))
step_secs = float(os.environ.get("DDP_STEP_SECS", "0.2"))
batch = int(os.environ.get("DDP_BATCH", "12"))
mode = os.environ.get("DDP_MODE", "ok")
log_path = os.environ.get("DDP_LOG")
ckpt_dir = os.environ["KEEL_CKPT_DIR"]
request_file = os.environ.get("KEEL_CKPT_REQUEST")
heartbeat_dir = os.environ.get("KEEL_HEARTBEAT_DIR")
ckpt_secs = float(os.environ.get("DDP_CKPT_SECS", "0"))
signalled = {"save": False, "exit": False}
if os.environ.get("DDP_ON_SIGNAL") == "1":
    def on_signal(signum, _frame):
        signalled["save"] = True
        if signum == signal.SIGTERM:
            signalled["exit"] = True

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
if batch % world:
    print(f"DDP_BATCH={batch} does not split over {world} ranks", file=sys.stderr)
    sys.exit(2)


def log(line):
    if log_path and rank == 0:
        with open(log_path, "a") as f:
            f.write(f"{line} {time.time():.3f}\n")


def fault_at(prefix):
    if not mode.startswith(prefix + ":"):
        return None
    if os.environ.get("DDP_FAULT_NODE", node) != node:
        return None
    f = os.environ.get("DDP_FAULT_FILE")
    if f and not os.path.exists(f):
        return None
    return int(mode.split(":", 1)[1])


torch.manual_seed(1234)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
).double()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
true_w = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)


def data(step):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(batch, 8, generator=g, dtype=torch.float64)
    y = (x @ true_w).tanh().unsqueeze(1) + 0.01 * torch.randn(batch, 1, generator=g, dtype=torch.float64)
    per = batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def state(step):
    msd, osd = get_state_dict(ddp, opt)
    return {"model": msd, "optim": osd, "step": torch.tensor(step)}


def latest_committed():
    """The newest step_<N> under the checkpoint directory that DCP
    committed (its .metadata written): how a trainer without keel run
    (DDP_RESUME_LATEST=1, the benchmark's baselines) finds where to
    resume."""
    best = None
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return None
    for name in names:
        if name.startswith("step_") and name[5:].isdigit():
            if os.path.exists(os.path.join(ckpt_dir, name, ".metadata")):
                n = int(name[5:])
                if best is None or n > best:
                    best = n
    return best


start = 0
resume_dir = os.environ.get("KEEL_RESUME_DIR")
if not resume_dir and os.environ.get("DDP_RESUME_LATEST") == "1":
    n = latest_committed()
    if n is not None:
        resume_dir = os.path.join(ckpt_dir, f"step_{n}")
        os.environ["KEEL_RESUME_STEP"] = str(n)
if resume_dir:
    sd = state(0)
    dcp.load(sd, checkpoint_id=resume_dir)
    set_state_dict(ddp, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    start = int(sd["step"])
    assert start == int(os.environ["KEEL_RESUME_STEP"]), (start, os.environ["KEEL_RESUME_STEP"])
    log(f"resumed {start}")
else:
    log("fresh")


def save(step):
    if ckpt_secs:
        log(f"saving {step}")
        time.sleep(ckpt_secs)
    dcp.save(state(step), checkpoint_id=os.path.join(ckpt_dir, f"step_{step}"))


last_request = None


def requested():
    """Rank 0 reads the request file; every rank learns its answer."""
    global last_request
    new = 0
    if rank == 0 and request_file:
        try:
            with open(request_file) as f:
                req = f.read()
        except FileNotFoundError:
            req = ""
        if req and req != last_request:
            last_request = req
            new = 1
        if signalled["save"]:
            signalled["save"] = False
            new = 2 if signalled["exit"] else 1
    flag = torch.tensor([new])
    dist.broadcast(flag, src=0)
    return int(flag.item())


def beat():
    if heartbeat_dir:
        mine = os.path.join(heartbeat_dir, node)
        with open(mine, "a"):
            os.utime(mine)


step = start
while step < steps:
    step += 1
    x, y = data(step)
    # The "compute": a hang here leaves this rank silent while the others
    # wait for it in the gradient all-reduce.
    time.sleep(step_secs)
    if fault_at("hang-at") == step:
        print(f"rank {rank} on {node}: hanging at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if fault_at("crash-at") == step:
        print(f"rank {rank} on {node}: step {step}: CUDA error: an illegal memory access", file=sys.stderr, flush=True)
        os._exit(1)
    beat()
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).sum() * world / batch
    loss.backward()
    opt.step()
    log(f"trained {step}")
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    asked = requested()
    if asked or step % every == 0:
        save(step)
    if asked == 2:
        log(f"stopping after {step} (SIGTERM)")
        break

if rank == 0 and os.environ.get("DDP_RESULT"):
    params = {k: [float(v).hex() for v in t.flatten().tolist()] for k, t in model.state_dict().items()}
    with open(os.environ["DDP_RESULT"] + ".tmp", "w") as f:
        json.dump({"step": step, "world": world, "params": params}, f)
    os.replace(os.environ["DDP_RESULT"] + ".tmp", os.environ["DDP_RESULT"])
dist.destroy_process_group()
