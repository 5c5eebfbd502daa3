"""What a model asks of the hardware: parameters, FLOPs and activation bytes, from formulas or a trace."""
