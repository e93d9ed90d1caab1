"""The draft tree: nodes stored in pop order, with everything a viewer or a verifier needs.

Node 0 is the root (the last committed token, not yet in the target KV cache). Every other node
``i`` has a parent ``parents[i] < i``: nodes are stored in the order best-first expansion popped
them, so every prefix of the node list is itself a valid tree. Plain Python lists keep the
structure cheap to build node by node; tensors (mask, position ids) are built on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """A token tree rooted at the last committed token.

    Attributes (all of length n, index = pop order):
        tokens:     token id of each node.
        parents:    index of the parent node, -1 for the root.
        depths:     0 for the root, parent depth + 1 otherwise.
        marginals:  q_d(token) of the drafter at that depth (1.0 for the root).
        path_probs: P(v) = product along the path from the root of the confidences the tree was built
                    from: the marginals, or their calibrated g(q) (calibration.py); 1.0 for the root.
        ranks:      rank of the token among the drafter's top-K at its depth (0 for the root; −1 for a
                    node proposed by prompt lookup, −2 for one from the datastore, whose marginal is
                    then that source's rate r).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    marginals: list[float] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        tree = cls()
        tree.add(root_token, -1, 1.0, 1.0, 0)
        return tree

    def add(self, token: int, parent: int, marginal: float, path_prob: float, rank: int) -> int:
        """Append a node; its parent must already be in the tree. Returns the new node index."""
        if parent >= len(self.tokens):
            raise ValueError(f"parent {parent} is not in the tree (size {len(self.tokens)})")
        depth = 0 if parent < 0 else self.depths[parent] + 1
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(depth)
        self.marginals.append(float(marginal))
        self.path_probs.append(float(path_prob))
        self.ranks.append(int(rank))
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths) if self.depths else 0

    @property
    def expected_tokens(self) -> float:
        """S(T) = sum of path confidences; the root's 1 stands for the bonus token."""
        return float(sum(self.path_probs))

    def children(self) -> list[list[int]]:
        """children[i] = indices of the nodes whose parent is i, in pop order."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean [n, n]: entry (i, j) is True iff j is i or an ancestor of i.

        Built row by row from the parent's row (parents precede children), O(n^2) bools.
        """
        n = len(self.tokens)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc.to(device)

    def prefix(self, n: int) -> "DraftTree":
        """The tree made of the first n nodes in pop order (always a valid tree)."""
        return DraftTree(*(list(col[:n]) for col in (self.tokens, self.parents, self.depths,
                                                     self.marginals, self.path_probs, self.ranks)))

    def to_dict(self) -> dict:
        return {
            "tokens": list(self.tokens),
            "parents": list(self.parents),
            "depths": list(self.depths),
            "marginals": [round(x, 6) for x in self.marginals],
            "path_probs": [round(x, 6) for x in self.path_probs],
            "ranks": list(self.ranks),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "DraftTree":
        tree = cls(
            tokens=[int(x) for x in data["tokens"]],
            parents=[int(x) for x in data["parents"]],
            depths=[int(x) for x in data["depths"]],
            marginals=[float(x) for x in data["marginals"]],
            path_probs=[float(x) for x in data["path_probs"]],
            ranks=[int(x) for x in data.get("ranks", [0] * len(data["tokens"]))],
        )
        tree.validate()
        return tree

    def validate(self) -> None:
        """Raise ValueError unless the structure is a tree stored in a valid pop order."""
        n = len(self.tokens)
        cols = (self.parents, self.depths, self.marginals, self.path_probs, self.ranks)
        if any(len(c) != n for c in cols):
            raise ValueError("tree columns differ in length")
        if n == 0 or self.parents[0] != -1 or self.depths[0] != 0:
            raise ValueError("node 0 must be the root (parent -1, depth 0)")
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede children")
            if self.depths[i] != self.depths[p] + 1:
                raise ValueError(f"node {i} has depth {self.depths[i]}, parent depth {self.depths[p]}")
