"""Side-by-side cost of ``ReplyBinder.check`` + ``ReplyScreen.run`` vs ``ReplyScreen.run`` alone: same process,
same 20 FedAvg replies of a 10 MB float32 model, 3 trials.

    PYTHONPATH=. python docs/results/reply_binding/cost.py
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import flower_strategies as fs
from flower_strategies.core import records as R
from flower_strategies.core.binding import ReplyBinder

N = 20
TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # messages outside a runtime
rng = np.random.default_rng(0)
current = {"w": rng.standard_normal((2500, 1000)).astype(np.float32), "b": np.zeros(1000, np.float32)}
strategy = fs.FedAvg()
strategy.current = R.views(R.to_record(current))


def reply(i: int) -> Message:
    arrays = {k: (v + np.float32(0.01 * (i + 1))).astype(np.float32) for k, v in current.items()}
    msg = Message(RecordDict({"arrays": R.to_record(arrays), "metrics": MetricRecord({"num-examples": 10})}), i + 1,
                  "train")
    msg.metadata.__dict__["_src_node_id"] = i + 1
    return msg


replies = [reply(i) for i in range(N)]
for _ in range(3):
    t0 = time.perf_counter()
    strategy.reply_screen().run(1, replies)
    t1 = time.perf_counter()
    screen = strategy.reply_screen()
    screen.run(1, ReplyBinder().check(1, replies, screen.current, screen.specs, screen.trainable, 0).passed)
    t2 = time.perf_counter()
    screen_s, bind_s = t1 - t0, t2 - t1
    print(f"{N} replies x {sum(v.nbytes for v in current.values()) / 1e6:.0f} MB: screen alone {screen_s:.3f} s, "
          f"binder+screen {bind_s:.3f} s (+{100 * (bind_s / screen_s - 1):.0f} %)")
