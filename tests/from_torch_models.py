"""Small PyTorch models the from_torch / torch.compile tests import into flowgen (import after
`pytest.importorskip("torch")`)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(self.gap(x), 1))


class TinyGPT(nn.Module):
    """Embeddings, one pre-norm transformer block (causal attention twice: SDPA and a masked
    softmax written out, averaged), GELU MLP, residuals, a head tied to the token embedding."""

    def __init__(self, vocab=32, block=8, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.fc_out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("causal", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.shape[-1] ** 0.5)
        att = att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(dim=-1)
        y = 0.5 * (fused + att @ v)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))
        x = x + self.fc_out(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x))


class OpZoo(nn.Module):
    """Many ATen ops in one forward (conv1d, transposed conv, GroupNorm, PReLU, slicing, gather,
    cumsum, var/std, max/min with indices, where, logic, activations, log_softmax): the import's
    table entries against PyTorch's numbers. Inputs: (x [2, 3, 5, 5], seq [2, 4, 7], idx [1, 1, 5])."""

    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(4, 6, 3, padding=1)
        self.deconv = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.prelu = nn.PReLU()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x, seq, idx):
        a = self.gn(F.silu(self.conv1d(seq)) * self.scale[:, None])
        b = torch.cat([a, torch.stack([a.mean(1), a.amax(1)], 1)], 1)
        b = F.hardtanh(b, -0.5, 0.5) + F.softplus(b) + F.leaky_relu(b, 0.2) + torch.clamp(b, min=-0.1) + F.selu(b)
        c = F.avg_pool2d(self.deconv(x), 2)
        d = torch.where(c > 0, c.exp().log1p(), -c.pow(2)).sum((2, 3))
        e = b.gather(2, idx.expand(b.shape[0], b.shape[1], -1)).cumsum(-1)
        f = torch.tanh(e).var(-1) + e.std(-1) + e.max(-1).values - e.min(-1)[0] + e.argmax(-1).float()
        r = torch.rsqrt(d.abs() + 1) / (1 + d.sigmoid()) - d.sin() * d.cos() + torch.erf(d) - d.abs().sqrt() * d.sign()
        mask = (e > 0.1) & (e < 0.9) | ~(e != 0)
        return self.prelu(d).sum() + F.log_softmax(f, -1).sum(), r, mask, f.flatten()


class _UNetBlock(nn.Module):
    """conv -> GroupNorm -> SiLU -> conv (no bias: BatchNorm follows) -> BatchNorm -> ReLU."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout)
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.norm2(self.conv2(F.silu(self.norm1(self.conv1(x))))))


class UNet(nn.Module):
    """A small UNet: two max-pooled downsamplings, a transposed-convolution and a nearest-neighbour
    upsampling, skip connections concatenated on the channels, a 1x1 convolution head."""

    def __init__(self, width=8, classes=2):
        super().__init__()
        c = width
        self.down1, self.down2, self.mid = _UNetBlock(3, c), _UNetBlock(c, 2 * c), _UNetBlock(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2, self.dec1 = _UNetBlock(4 * c, 2 * c), _UNetBlock(3 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        u1 = self.dec1(torch.cat([F.interpolate(u2, scale_factor=2, mode="nearest"), d1], 1))
        return self.head(u1)


class Upsampler(nn.Module):
    """Resizing as decoders do: a transposed convolution with output_padding, nearest upsampling by
    a size and by a scale factor, bilinear with and without align_corners (a non-integer scale)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.conv = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        y = self.up(x)                                             # [N, 4, 2H, 2W]
        a = F.interpolate(x, size=tuple(y.shape[2:]), mode="nearest")
        b = F.interpolate(F.interpolate(x, scale_factor=2, mode="nearest"), scale_factor=0.5, mode="bilinear")
        c = F.interpolate(y, scale_factor=1.5, mode="bilinear", align_corners=True)
        return self.conv(y + a.mean(1, keepdim=True)).mean((2, 3)) + b.mean() + c.square().mean((1, 2, 3))[:, None]
