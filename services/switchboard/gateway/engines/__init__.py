"""The gateway's side of the engine wire: the client that talks to every engine core (ADD, ABORT,
the output stream), the pool that routes among them, the handshake server engines register with,
utility calls, and the clock that maps engine timestamps onto the gateway's. These modules
import only ``gateway.errors`` and ``wire/``."""
