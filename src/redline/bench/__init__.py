"""`redline bench`: what the server really delivers, measured side by side with its physical peak."""
