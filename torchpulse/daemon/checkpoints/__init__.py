"""The daemon's checkpoint half: the roots it watches (configured and announced by jobs), the watcher, the
scans and their debounce, the validation queue and its worker processes, the state store of results, and
the sweeps that prune them. `service.CheckpointService` composes them."""
