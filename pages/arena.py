"""Arena: the same prompt from many users, on the local PC and the datacenter engine."""

from ui import arena

arena.intro()
arena.controls()
arena.live()
arena.how_measured()
