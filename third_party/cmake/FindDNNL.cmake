# FindDNNL: oneDNN (Debian's libdnnl-dev) without its CMake package, whose
# config insists on OpenCL development files for a GPU runtime tandem never uses.
# Defines DNNL_FOUND, DNNL_INCLUDE_DIR, DNNL_LIBRARY, DNNL_VERSION and the
# imported target DNNL::dnnl. Hints: DNNL_ROOT.
find_path(DNNL_INCLUDE_DIR dnnl.hpp HINTS ${DNNL_ROOT} PATH_SUFFIXES include)
find_library(DNNL_LIBRARY NAMES dnnl HINTS ${DNNL_ROOT} PATH_SUFFIXES lib lib64)
if(DNNL_INCLUDE_DIR)
  foreach(dir "${DNNL_INCLUDE_DIR}/oneapi/dnnl" "${DNNL_INCLUDE_DIR}")
    if(EXISTS "${dir}/dnnl_version.h")
      file(STRINGS "${dir}/dnnl_version.h" _dnnl_v REGEX "#define DNNL_VERSION_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
             DNNL_VERSION "${_dnnl_v}")
      break()
    endif()
  endforeach()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(DNNL REQUIRED_VARS DNNL_LIBRARY DNNL_INCLUDE_DIR
                                  VERSION_VAR DNNL_VERSION)
if(DNNL_FOUND AND NOT TARGET DNNL::dnnl)
  add_library(DNNL::dnnl UNKNOWN IMPORTED)
  set_target_properties(DNNL::dnnl PROPERTIES IMPORTED_LOCATION "${DNNL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${DNNL_INCLUDE_DIR}")
endif()
mark_as_advanced(DNNL_INCLUDE_DIR DNNL_LIBRARY)
