"""Keys the ServerApp and the ClientApp exchange beside the library's: a method's client state
(``client_app/client_state.py``) and the round's sampled partitions (per-round partitioners)."""

#: Round-config key: the run token naming the run's client state (sent only by runs that write checkpoints).
CLIENT_STATE_KEY = "client-state-key"
#: Round-config key: the last round whose server checkpoint was written (0: none yet).
CLIENT_STATE_KEEP = "client-state-keep"
#: Round-config key: the round the run resumed after (0: a fresh run).
CLIENT_STATE_BASE = "client-state-base"
#: Reply-info key (``fedadapt`` ConfigRecord of a train reply): where the client's state came from this round.
STATUS = "client-state"
#: Round-config key (partitioner round-iid / round-class): the round's sampled partition ids, in sampling order; a
#: client's position in it is its slot in the round's allocation (``app_common.partitions.round_allocation``).
ROUND_PARTITIONS = "round-partitions"
