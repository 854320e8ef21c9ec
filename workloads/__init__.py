"""What drives a serving side: the race, the load sweep, scripted scenarios, background jobs."""
