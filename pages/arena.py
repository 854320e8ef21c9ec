"""Arena: the same prompt from many users, on the local PC and the datacenter engine."""

from ui import arena, presenter

arena.intro()
if presenter.is_on():
    presenter.scenario_bar(disabled=arena.is_running())
arena.controls()
arena.live()
arena.how_measured()
