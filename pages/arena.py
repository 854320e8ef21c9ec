"""Arena: the same prompt from many users, on the local PC and the datacenter engine."""

from ui import arena, scenario_bar, speculative_view

arena.intro()
scenario_bar.show()  # presenter mode only: the scripted scenarios, one click each
speculative_view.live()  # "edit a paragraph": speculative decoding off and on, once started
arena.controls()
arena.live()
arena.how_measured()
