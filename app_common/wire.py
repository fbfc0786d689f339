"""Keys the ServerApp and the ClientApp exchange about a method's client state (``client_app/client_state.py``)."""

#: Round-config key: the run token naming the run's client state (sent only by runs that write checkpoints).
CLIENT_STATE_KEY = "client-state-key"
#: Round-config key: the last round whose server checkpoint was written (0: none yet).
CLIENT_STATE_KEEP = "client-state-keep"
#: Round-config key: the round the run resumed after (0: a fresh run).
CLIENT_STATE_BASE = "client-state-base"
#: Reply-info key (``fedadapt`` ConfigRecord of a train reply): where the client's state came from this round.
STATUS = "client-state"
