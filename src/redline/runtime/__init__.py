"""Training runtime: apply a plan to the user's loop, measure it, checkpoint it."""
