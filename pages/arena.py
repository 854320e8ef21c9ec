"""Arena: the same prompt from many users, on the local PC and the datacenter engine."""

from ui import arena, presenter, spec_view

arena.intro()
presenter.scenario_bar()  # presenter mode only: the scripted scenarios, one click each
spec_view.live()  # "edit a paragraph": speculative decoding off and on, once started
arena.controls()
arena.live()
arena.how_measured()
