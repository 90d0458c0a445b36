// Freeing a tensor's storage in place and filling it again, which tch does not expose (PyTorch's
// `untyped_storage().resize_(0)` and FSDP2's re-allocation before the all-gather). Every tensor sharing the storage,
// including the ones an autograd graph saved, sees the change: a freed storage holds 0 bytes, a refilled one the new
// values at a possibly different address.
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

extern "C" {

// Bytes the storage of `t` holds now.
int64_t ferl_storage_nbytes(const at::Tensor *t) {
    if (!t->defined() || !t->has_storage()) {
        return 0;
    }
    return static_cast<int64_t>(t->storage().nbytes());
}

// Frees the bytes of `t`'s storage (its allocator gets them back now), keeping the storage object, its device and
// allocator. Returns the bytes freed, or -1 when `t` has no storage.
int64_t ferl_storage_free(const at::Tensor *t) {
    if (!t->defined() || !t->has_storage()) {
        return -1;
    }
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    int64_t n = static_cast<int64_t>(s->nbytes());
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
    s->set_nbytes(0);
    return n;
}

// Gives `dst`'s storage the values of `src` (same dtype, device and number of elements; `dst` contiguous from the
// storage's start). When `src` is the only user of a storage of exactly the size `dst` needs, its allocation moves
// over (no copy) and `*stolen` is 1; otherwise `dst`'s allocator provides the bytes and `src` is copied. Returns null
// on success or a malloc'd message.
char *ferl_storage_refill(const at::Tensor *dst, const at::Tensor *src, int *stolen) {
    try {
        *stolen = 0;
        TORCH_CHECK(dst->defined() && dst->has_storage(), "refill: destination has no storage");
        TORCH_CHECK(src->defined(), "refill: source undefined");
        TORCH_CHECK(dst->scalar_type() == src->scalar_type(), "refill: dtype ", dst->scalar_type(), " vs ",
                    src->scalar_type());
        TORCH_CHECK(dst->device() == src->device(), "refill: device ", dst->device(), " vs ", src->device());
        TORCH_CHECK(dst->numel() == src->numel(), "refill: ", dst->numel(), " vs ", src->numel(), " elements");
        TORCH_CHECK(dst->storage_offset() == 0 && dst->is_contiguous(),
                    "refill: destination must be contiguous from its storage's start");
        const size_t need = static_cast<size_t>(dst->numel()) * dst->itemsize();
        c10::StorageImpl *d = dst->storage().unsafeGetStorageImpl();
        const at::Storage &ss = src->storage();
        if (src->has_storage() && ss.use_count() == 1 && src->storage_offset() == 0 && src->is_contiguous() &&
            ss.nbytes() == need && ss.unsafeGetStorageImpl() != d) {
            c10::StorageImpl *s = ss.unsafeGetStorageImpl();
            at::DataPtr bytes = s->set_data_ptr(at::DataPtr(nullptr, s->device()));
            s->set_nbytes(0);
            d->set_data_ptr_noswap(std::move(bytes));
            d->set_nbytes(need);
            *stolen = 1;
            return nullptr;
        }
        TORCH_CHECK(d->allocator() != nullptr, "refill: destination storage has no allocator");
        d->set_data_ptr_noswap(d->allocator()->allocate(need));
        d->set_nbytes(need);
        // A fresh tensor over the storage: the copy does not bump the version counter autograd checks on `dst`.
        at::NoGradGuard no_grad;
        at::Tensor alias = at::empty({0}, dst->options());
        alias.set_(dst->storage(), 0, dst->sizes(), dst->strides());
        alias.copy_(*src);
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}

// Frees a message returned by any of the crate's shims (ferl_storage_refill, ferl_w_xt, ferl_varlen_attention,
// ferl_packed_attention_cpu).
void ferl_storage_message_free(char *message) { free(message); }
}
