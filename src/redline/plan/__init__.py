"""Pure models of memory, step time and cost per strategy, and the search over strategies and machines."""
