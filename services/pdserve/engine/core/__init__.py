"""The scheduling core: what runs each step (scheduler, sequences, stopping, detokenizing) and the step loop."""
