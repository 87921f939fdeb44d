import numpy as np
import pytest

from recmem.archive.index import UserAddressIndex, gpu_resources, open_dims
from recmem.archive.selection import l2_normalise


def test_similarities_match_brute_force_per_channel_cosine():
    rng = np.random.default_rng(0)
    n_notes, ch, dim = 30, 5, 6
    rho = l2_normalise(rng.normal(size=(n_notes, ch, dim)))
    u = l2_normalise(rng.normal(size=(7, ch, dim)))
    index = UserAddressIndex(ch, dim)
    index.add(rho[:10])
    index.add(rho[10:])
    assert index.size == n_notes
    sims = index.similarities(u)
    cos = np.einsum("tcd,ncd->tcn", u, rho)  # [query, channel, note]
    np.testing.assert_allclose(sims, cos, atol=1e-5)


def test_a_channel_never_matches_another_channels_address():
    ch, dim = 3, 4
    rho = np.zeros((2, ch, dim), np.float32)
    rho[0, 1] = [1, 0, 0, 0]  # note 0 has the query's direction, but on channel 1
    rho[1, 0] = [0.6, 0.8, 0, 0]  # note 1 is only partly aligned, on channel 0
    index = UserAddressIndex(ch, dim)
    index.add(rho)
    u = np.zeros((1, ch, dim), np.float32)
    u[0, 0] = [1, 0, 0, 0]
    sims = index.similarities(u)
    np.testing.assert_allclose(sims[0, 0], [0.0, 0.6], atol=1e-6)


def test_rebuild_and_empty_index():
    rng = np.random.default_rng(1)
    rho = l2_normalise(rng.normal(size=(4, 2, 3)))
    index = UserAddressIndex(2, 3)
    assert index.similarities(rho[:1]).shape == (1, 2, 0)
    index.add(rho)
    index.rebuild(rho[2:])
    assert index.size == 2
    sims = index.similarities(rho[3:4])
    assert sims.shape == (1, 2, 2) and sims[0].argmax(axis=1).tolist() == [1, 1]


def test_cpu_faiss_has_no_gpu_and_demanding_one_fails_clearly():
    import faiss

    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("this faiss has a GPU")
    assert gpu_resources(None) is None
    with pytest.raises(ValueError, match="GPU"):
        gpu_resources(True)


def test_gpu_search_path_logic_matches_on_a_cpu_index():
    # The GPU path (search all rows, pick the channel's columns) run on a CPU flat index.
    rng = np.random.default_rng(2)
    rho = l2_normalise(rng.normal(size=(9, 4, 5)))
    u = l2_normalise(rng.normal(size=(3, 4, 5)))
    index = UserAddressIndex(4, 5)
    index.add(rho)
    queries = np.ascontiguousarray(u.reshape(12, 5))
    np.testing.assert_allclose(
        index._inner_products_gpu(queries, 3), index._inner_products(queries, 3), atol=1e-5
    )


def test_cosine_is_taken_on_the_notes_open_prefix():
    # Note 0 was written with only 3 of 6 coordinates open (Proteus): zeros after them.
    rng = np.random.default_rng(3)
    rho = l2_normalise(rng.normal(size=(2, 1, 6)))
    rho[0, 0, 3:] = 0.0
    rho = l2_normalise(rho)
    assert open_dims(rho).tolist() == [[3], [6]]
    u = l2_normalise(rng.normal(size=(1, 1, 6)))
    index = UserAddressIndex(1, 6)
    index.add(rho)
    sims = index.similarities(u)[0, 0]
    head = u[0, 0, :3]
    assert sims[0] == pytest.approx(head @ rho[0, 0, :3] / np.linalg.norm(head), abs=1e-5)
    assert sims[1] == pytest.approx(u[0, 0] @ rho[1, 0], abs=1e-5)
    # A query equal to the truncated address matches it perfectly, whatever else it holds.
    q = u.copy()
    q[0, 0, :3] = rho[0, 0, :3]
    assert index.similarities(l2_normalise(q))[0, 0, 0] == pytest.approx(1.0, abs=1e-5)
    index.rebuild(rho[1:])
    assert open_dims(rho[1:]).tolist() == [[6]] and index.similarities(u).shape == (1, 1, 1)
    zero = np.zeros((1, 1, 6), np.float32)
    index.add(zero)
    assert index.similarities(u)[0, 0, 1] == 0.0
