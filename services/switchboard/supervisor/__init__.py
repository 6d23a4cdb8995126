"""The supervisor of `switchboard serve`: the launcher that starts, watches and restarts
every process of a topology on one machine, and how it starts them."""
