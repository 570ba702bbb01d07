#!/usr/bin/env python3
"""A toy trainer for `keel run` tests: one "step" every TOY_STEP_SECS,
a PyTorch DCP-shaped checkpoint directory (step_<N>/__0_0.distcp, then
.metadata last) every TOY_EVERY steps under $KEEL_CKPT_DIR, and on the
checkpoint request (a new content in $KEEL_CKPT_REQUEST, or SIGUSR1 when
keel run is given --checkpoint-signal USR1) a checkpoint at the next step
boundary.

Environment:
  TOY_STEPS      train until this step, then exit 0 (default 20)
  TOY_EVERY      checkpoint interval in steps (default 5)
  TOY_STEP_SECS  seconds per step (default 0.1)
  TOY_LOG        a file that gets "trained N" for every step trained
                 and "resumed N" / "fresh" at start
  TOY_SAVE_SECS  seconds a save takes between its data and .metadata
  TOY_TIMES      when set, each log line ends with the Unix time
  TOY_MODE       ok | crash-at:N | hang-at:N | ignore-signals | startup-fail
  TOY_HANG_NODE  with hang-at: hang only on this node
  TOY_CRASH_NODE with crash-at: crash only where SLURMD_NODENAME (or
                 the host name) equals this
Under srun (SLURM_PROCID) every task steps; only rank 0 logs and saves.
"""
import os
import signal
import socket
import sys
import time

steps = int(os.environ.get("TOY_STEPS", "20"))
every = int(os.environ.get("TOY_EVERY", "5"))
step_secs = float(os.environ.get("TOY_STEP_SECS", "0.1"))
mode = os.environ.get("TOY_MODE", "ok")
log_path = os.environ.get("TOY_LOG")
ckpt_dir = os.environ["KEEL_CKPT_DIR"]
heartbeat = os.environ.get("KEEL_HEARTBEAT_FILE")
node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
# Under srun every task trains; only rank 0 logs and writes checkpoints.
rank = int(os.environ.get("SLURM_PROCID", "0"))


def log(line):
    if log_path and rank == 0:
        if os.environ.get("TOY_TIMES"):
            line = f"{line} {time.time():.3f}"
        with open(log_path, "a") as f:
            f.write(line + "\n")


def at(prefix):
    if mode.startswith(prefix + ":"):
        return int(mode.split(":", 1)[1])
    return None


if mode == "startup-fail":
    print("cannot initialise the process group", file=sys.stderr, flush=True)
    sys.exit(3)

start = 0
resume_dir = os.environ.get("KEEL_RESUME_DIR")
if resume_dir:
    start = int(os.environ["KEEL_RESUME_STEP"])
    with open(os.path.join(resume_dir, "__0_0.distcp")) as f:
        saved = int(f.read().split()[1])
    assert saved == start, (saved, start)
    log(f"resumed {start}")
else:
    log("fresh")

asked = False
request_file = os.environ.get("KEEL_CKPT_REQUEST")
last_request = None


def requested():
    """Whether keel run wrote a request not answered yet."""
    global last_request
    if not request_file:
        return False
    try:
        with open(request_file) as f:
            req = f.read()
    except FileNotFoundError:
        return False
    if req and req != last_request:
        last_request = req
        return True
    return False



def on_signal(signum, frame):
    global asked
    asked = True


if mode == "ignore-signals":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGUSR1, on_signal)


def save(step):
    if rank != 0:
        return
    d = os.path.join(ckpt_dir, f"step_{step}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "__0_0.distcp"), "w") as f:
        f.write(f"step {step}\n" + "x" * 4096)
    time.sleep(float(os.environ.get("TOY_SAVE_SECS", "0")))
    with open(os.path.join(d, ".metadata"), "w") as f:
        f.write(f"dcp metadata for step {step}\n")


step = start
while step < steps:
    step += 1
    if at("hang-at") == step and os.environ.get("TOY_HANG_NODE", node) == node:
        while True:
            time.sleep(3600)
    if at("crash-at") == step and os.environ.get("TOY_CRASH_NODE", node) == node:
        print(f"step {step}: CUDA error: an illegal memory access", file=sys.stderr, flush=True)
        os._exit(1)
    time.sleep(step_secs)
    log(f"trained {step}")
    if rank == 0:
        print(f"step {step} loss {1.0 / step:.4f}", flush=True)
    if heartbeat:
        with open(heartbeat, "a"):
            os.utime(heartbeat)
    if os.environ.get("KEEL_HEARTBEAT_DIR"):
        mine = os.path.join(os.environ["KEEL_HEARTBEAT_DIR"], node)
        with open(mine, "a"):
            os.utime(mine)
    if mode != "ignore-signals" and requested():
        asked = True
    if step % every == 0 or asked:
        save(step)
        asked = False
sys.exit(0)
