"""The data plane: shared-memory segments, frames and their (de)serialization, sockets,
the poll loop, per-edge windows."""
