// What differs between torch 1.x's and 2.x's c10d for a backend written outside torch, in one
// place; the rest of the extension names CollectiveBase and nothing else.
//   - The class a backend's collectives override. torch 1.x's ProcessGroup is itself the backend:
//     its collectives are virtual and the creator torch.distributed calls returns one. torch 2.x's
//     ProcessGroup dispatches each device type's collectives to a c10d::Backend registered for it
//     (which is what lets "cpu:lockstep,cuda:nccl" name one per device), and a backend derives from
//     c10d::Backend. (1.13 ships a Backend.hpp too, but its ProcessGroup never calls one.)
//   - The coalesced tensor forms (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced,
//     which FSDP2 and the coalescing manager call) are virtual from 2.x on: LOCKSTEP_OVERRIDE_2X
//     marks their definitions `override` there; on 1.x they are plain members nobody calls.
// The base is told apart by what ProcessGroup declares (2.x's has getDefaultBackend()), not by a
// version number, so a release that changes this breaks the build here, where it is easy to see;
// `override` needs the preprocessor, and the assertion below keeps the two tests in agreement.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <torch/version.h>

#include <type_traits>
#include <utility>

namespace lockstep::torch_backend {

template <class PG, class = void>
struct dispatches_to_backends : std::false_type {};
template <class PG>
struct dispatches_to_backends<PG, std::void_t<decltype(std::declval<PG&>().getDefaultBackend())>>
    : std::true_type {};

// True where torch.distributed wants a c10d::Backend from a backend's creator (torch 2.x).
inline constexpr bool kBackendApi = dispatches_to_backends<c10d::ProcessGroup>::value;

using CollectiveBase = std::conditional_t<kBackendApi, c10d::Backend, c10d::ProcessGroup>;

#if TORCH_VERSION_MAJOR >= 2
#define LOCKSTEP_OVERRIDE_2X override
#else
#define LOCKSTEP_OVERRIDE_2X
#endif
static_assert(kBackendApi == (TORCH_VERSION_MAJOR >= 2), "c10d_compat.h: a torch whose c10d this file does not know");

}  // namespace lockstep::torch_backend
