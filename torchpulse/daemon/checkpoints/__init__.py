"""The daemon's checkpoint half, one owner per part, composed by `service.CheckpointService`:

- `root_set`: the roots wanted, configured and announced by jobs, and their TTL;
- `roots` and `watcher`: each root's watch, off the event loop;
- `queue`: committed checkpoints debounced and waiting, a bounded number validated at once;
- `validation` and `runner`: one checkpoint judged in a worker process;
- `records` and `state`: results kept in the state store, and exported through `stats`;
- `sweeps` and `scan`: what events missed, found periodically, and records of deleted checkpoints pruned;
- `announcements` and `mounts`: agents' announcements checked before anything here trusts them.
"""
