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
