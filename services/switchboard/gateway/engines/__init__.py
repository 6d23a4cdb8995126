"""The gateway's side of the engine wire: its sockets, which engine cores it has and their health,
a request's way to an engine and back (ADD, ABORT, the output stream), resume after an engine's
death, the pool that routes among engines, the handshake server engines register with, utility
calls, and the clock that maps engine timestamps onto the gateway's; ``engine_client.py`` holds
them together. These modules import only ``gateway.errors`` and ``wire/``."""
