"""Seeds 000-002: reuse an eager module in an nn.Graph and call it."""
import flowgen as flow
import flowgen.nn as nn

device = "cuda" if flow.cuda.is_available() else "cpu"


class ModuleMyLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(flow.randn(in_features, out_features))
        self.bias = nn.Parameter(flow.randn(out_features))

    def forward(self, input):
        return flow.matmul(input, self.weight) + self.bias


linear_model = ModuleMyLinear(4, 3).to(device)


class GraphMyLinear(nn.Graph):
    def __init__(self):
        super().__init__()
        self.model = linear_model

    def build(self, input):
        return self.model(input)


def main():
    graph_mylinear = GraphMyLinear()
    input = flow.randn(1, 4).to(device)
    out = graph_mylinear(input)
    print(out)
    print(graph_mylinear)
    eager = linear_model(input)
    print("max |graph - eager| =", float(abs(out - eager).max()))
    return out, eager


if __name__ == "__main__":
    main()
