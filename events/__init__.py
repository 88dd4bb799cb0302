"""arenaflow's event contract. Imports nothing from the consumers or the gateway."""

from events import battles  # noqa: F401 - registers the battle events with the codec
from events.codec import decode, decode_terminal, encode
from events.models import *  # noqa: F403

__all__ = ["decode", "decode_terminal", "encode"]
