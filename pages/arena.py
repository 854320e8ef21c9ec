"""Arena: the same prompt from many users, on the local PC and the datacenter engine."""

from ui import arena, presenter

arena.intro()
presenter.scenario_bar()  # presenter mode only: the scripted scenarios, one click each
arena.controls()
arena.live()
arena.how_measured()
