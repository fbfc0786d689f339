"""Side-by-side cost of ``ReplyBinder.run`` (binding checks + screen) vs ``ReplyScreen.run`` alone: same process,
same 20 FedAvg replies of a 10 MB float32 model, 3 trials.  ``PYTHONPATH=. python docs/results/reply_binding/cost.py``."""
import time
import numpy as np
import flower_strategies as fs
from flwr.app import Message, MetricRecord, RecordDict
from flower_strategies.core import records as R
from flower_strategies.core.binding import ReplyBinder
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
rng = np.random.default_rng(0)
current = {"w": rng.standard_normal((2500, 1000)).astype(np.float32), "b": np.zeros(1000, np.float32)}
s = fs.FedAvg()
s.current = R.views(R.to_record(current))
def replies(n):
    out = []
    for i in range(n):
        arrays = {k: (v + np.float32(0.01 * (i + 1))).astype(np.float32) for k, v in current.items()}
        content = RecordDict({"arrays": R.to_record(arrays), "metrics": MetricRecord({"num-examples": 10})})
        m = Message(content, i + 1, "train")
        m.metadata.__dict__["_src_node_id"] = i + 1
        out.append(m)
    return out
N = 20
reps = replies(N)
for trial in range(3):
    t = time.perf_counter(); s.reply_screen().run(1, reps); screen_s = time.perf_counter() - t
    b = ReplyBinder(); t = time.perf_counter(); b.run(1, reps, s.reply_screen(), 0); bind_s = time.perf_counter() - t
    print(f"{N} replies x {sum(v.nbytes for v in current.values())/1e6:.0f} MB: screen alone {screen_s:.3f} s, "
          f"binder+screen {bind_s:.3f} s (+{100*(bind_s/screen_s-1):.0f} %)")
