"""The output buffer pool: reuse only what torch has let go of."""

import torch

import ce_tvm
from ce_tvm.runtime.pool import BufferPool

SHAPE = (512, 1024)  # 2 MiB of float32, above the pooling threshold


def test_reuses_a_buffer_once_released():
    pool = BufferPool(64 << 20)
    a = pool.empty(SHAPE, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    del a
    b = pool.empty(SHAPE, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == ptr and b.is_contiguous() and b._base is None


def test_never_reuses_a_buffer_still_referenced_through_a_view():
    pool = BufferPool(64 << 20)
    a = pool.empty(SHAPE, torch.float32, torch.device("cpu"))
    view = a[3:].view(-1)
    ptr = a.data_ptr()
    del a
    b = pool.empty(SHAPE, torch.float32, torch.device("cpu"))
    assert b.data_ptr() != ptr  # the view still holds the first buffer
    del view  # now nothing does; b still holds the second
    c = pool.empty(SHAPE, torch.float32, torch.device("cpu"))
    assert c.data_ptr() == ptr and b.data_ptr() != ptr
    assert pool.pooled_bytes() == 2 * b.numel() * b.element_size()  # no third buffer


def test_idle_buffers_that_do_not_fit_make_room_under_the_cap():
    """Under a 7 MiB cap, with a 2 MiB buffer in use and an idle 4 MiB one, a 5 MiB
    request fits in neither: the idle buffer is dropped (the one in use is not)
    and the new one is pooled, and handed out again once released."""
    pool, cpu = BufferPool(7 << 20), torch.device("cpu")
    busy = pool.empty((2 << 20,), torch.uint8, cpu)
    idle = pool.empty((4 << 20,), torch.uint8, cpu)
    del idle
    assert pool.pooled_bytes() == 6 << 20
    new = pool.empty((5 << 20,), torch.uint8, cpu)
    # (the allocator may hand the dropped buffer's address to the new one: sizes tell)
    assert sorted(b.numel() for b, _ in pool._buffers) == [2 << 20, 5 << 20]
    assert pool.pooled_bytes() == 7 << 20
    assert busy.data_ptr() in [b.data_ptr() for b, _ in pool._buffers]
    new_ptr = new.data_ptr()
    del new
    assert pool.empty((5 << 20,), torch.uint8, cpu).data_ptr() == new_ptr


def test_cap_and_small_tensors_bypass_the_pool():
    off = BufferPool(0)
    off.empty(SHAPE, torch.float32, torch.device("cpu"))
    assert off.pooled_bytes() == 0
    small = BufferPool(64 << 20)
    small.empty((10, 10), torch.float32, torch.device("cpu"))
    assert small.pooled_bytes() == 0


def test_recycled_gradients_are_correct_step_after_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(600, 1000, generator=gen, requires_grad=True)
    seen = set()
    for step in range(3):
        y = torch.randint(0, 1000, (600,), generator=gen)
        ce_tvm.cross_entropy(x, y, label_smoothing=0.1).backward()
        xr = x.detach().clone().requires_grad_()
        torch.nn.functional.cross_entropy(xr, y, label_smoothing=0.1).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-8)
        seen.add(x.grad.data_ptr())
        x.grad = None
    assert len(seen) == 1  # the same memory every step: no new pages


def _reference_head_grads(x, W, y):
    xr, Wr = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    logp = torch.log_softmax(xr @ Wr.t(), -1).gather(1, y[:, None]).squeeze(1)
    logp.sum().backward()
    return xr.grad, Wr.grad


def test_fused_head_gradients_recycled_and_never_overwritten_while_kept():
    """The fused heads' ``grad_W`` comes from the pool: dropped after a step, the
    same memory serves the next; one still held is not reused, and keeps the
    values of its own step."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=gen, requires_grad=True)
    W = (0.1 * torch.randn(8192, 64, generator=gen)).requires_grad_()  # grad_W: 2 MiB
    ptrs, held = [], None
    for step in range(4):
        y = torch.randint(0, 8192, (512,), generator=gen)
        ce_tvm.linear_log_probs(x, W, y).sum().backward()
        gx, gW = _reference_head_grads(x, W, y)
        torch.testing.assert_close(x.grad, gx, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(W.grad, gW, rtol=1e-4, atol=1e-6)
        ptrs.append(W.grad.data_ptr())
        if step == 1:
            held = (W.grad, gW)
        x.grad = W.grad = None
    assert ptrs[1] == ptrs[0]  # recycled
    assert ptrs[2] != ptrs[1] and ptrs[3] == ptrs[2]  # the held one is left alone
    torch.testing.assert_close(held[0], held[1], rtol=1e-4, atol=1e-6)
