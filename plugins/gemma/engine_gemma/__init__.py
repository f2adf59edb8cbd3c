"""engine-gemma: Google's Gemma 3 text models for engine."""
