"""arenaflow's event contract. Imports nothing from the consumers or the gateway."""

from events.codec import decode, encode
from events.models import *  # noqa: F403
