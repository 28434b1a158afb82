"""What the three protocols share for tools and constrained output: tool plans, the forced-call
grammar, structured output and logit bias."""
