"""Studies behind `ddtree bench at-scale | prefix-cache` and `ddtree bench rounds --peer-checkout`:
serving at production shapes from inflated pairs, the paper's code on the same weights, op
counts of captured graphs, the prefix cache on vs off."""
