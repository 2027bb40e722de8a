# The steps of the install tests (tests/install/CMakeLists.txt says which test runs
# which), run as cmake -DSTEP=... -P install_test.cmake:
#   install  `cmake --install` of the build into a staged prefix; fails when a file
#            lands outside the prefix. Writes the installed headers' list.
#   example  configures, builds and runs consumer/ against that prefix, with
#            GoogleTest's find disabled (the core package must not need it): two
#            ranks training, a fault, a hapi fit, LeNet and ResNet-18 (tandem::models).
#   testing  configures, builds and runs testing_consumer/: a user's GoogleTest
#            tests of a training function through tandem::testing_gtest.
#   headers  configures and builds headers/: every installed header compiled alone.
#   programs runs the installed bin/train_linear (--help, then two CPU ranks for two
#            steps) from the prefix, as a user who put its bin/ on PATH would.
# Inputs: STEP, BUILD_DIR (the tandem build), WORK_DIR (this test's scratch folder),
# CONFIG, GENERATOR, CXX_COMPILER, CXX_LAUNCHER (may be empty), INCLUDEDIR; and the
# search hints the build was given (CUDAToolkit_ROOT, CUDNN_ROOT, NCCL_ROOT, DNNL_ROOT,
# MPI_HOME), passed on to the outside projects as a user on that machine would.
cmake_minimum_required(VERSION 3.25)

# The install goes through DESTDIR into WORK_DIR/stage: a rule with an absolute
# destination then lands in the stage too, outside the prefix, where the check
# below names it, instead of writing to the machine's root folder. The package
# must not care where its prefix ends up (CMake's export and PACKAGE_INIT are
# relative to the installed files).
set(stage "${WORK_DIR}/stage")
set(install_prefix "/prefix")
set(prefix "${stage}${install_prefix}")  # where the outside projects find the package
set(headers_list "${WORK_DIR}/installed_headers.txt")
if(NOT CONFIG)
  set(CONFIG Release)
endif()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc TIMEOUT 540)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "failed (${rc}): ${command}")
  endif()
endfunction()

# Configures and builds the outside project in `source_dir` against the staged prefix.
function(build_outside source_dir binary_dir)
  set(args -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=${CONFIG} "-DCMAKE_PREFIX_PATH=${prefix}"
      "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
  if(CXX_LAUNCHER)
    list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER}")
  endif()
  foreach(hint CUDAToolkit_ROOT CUDNN_ROOT NCCL_ROOT DNNL_ROOT MPI_HOME)
    if(NOT "${${hint}}" STREQUAL "")
      list(APPEND args "-D${hint}=${${hint}}")
    endif()
  endforeach()
  # From scratch: a cache left by an earlier run would hide a find that now fails.
  file(REMOVE_RECURSE "${binary_dir}")
  run(${CMAKE_COMMAND} -S "${source_dir}" -B "${binary_dir}" ${args} ${ARGN})
  run(${CMAKE_COMMAND} --build "${binary_dir}" --parallel 2)
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${WORK_DIR}")
  set(ENV{DESTDIR} "${stage}")
  run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix ${install_prefix} --config ${CONFIG})
  unset(ENV{DESTDIR})
  # The manifest lists every file installed, without the DESTDIR in front.
  file(STRINGS "${BUILD_DIR}/install_manifest.txt" installed)
  set(outside "")
  set(headers "")
  foreach(file IN LISTS installed)
    string(FIND "${file}" "${install_prefix}/" at)
    if(NOT at EQUAL 0)
      list(APPEND outside "${file}")
      continue()
    endif()
    string(LENGTH "${install_prefix}/" length)
    string(SUBSTRING "${file}" ${length} -1 file)
    if(file MATCHES "^${INCLUDEDIR}/tandem/(.+\\.h)$")
      list(APPEND headers "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  if(outside)
    list(JOIN outside "\n  " outside)
    message(FATAL_ERROR "installed outside the prefix (an absolute DESTINATION?):\n  ${outside}")
  endif()
  if(NOT headers)
    message(FATAL_ERROR "no header installed under ${INCLUDEDIR}/tandem")
  endif()
  list(LENGTH headers count)
  message(STATUS "${count} headers installed under ${INCLUDEDIR}/tandem")
  list(JOIN headers "\n" headers)
  file(WRITE "${headers_list}" "${headers}\n")
elseif(STEP STREQUAL "example")
  build_outside("${CMAKE_CURRENT_LIST_DIR}/consumer" "${WORK_DIR}/example"
                -DCMAKE_DISABLE_FIND_PACKAGE_GTest=TRUE)
  run("${WORK_DIR}/example/train_two_ranks")
  run("${WORK_DIR}/example/fault_check")
  run("${WORK_DIR}/example/fit_circle")
  run("${WORK_DIR}/example/models_check")
elseif(STEP STREQUAL "testing")
  build_outside("${CMAKE_CURRENT_LIST_DIR}/testing_consumer" "${WORK_DIR}/testing")
  run("${WORK_DIR}/testing/trainer_test")
elseif(STEP STREQUAL "headers")
  build_outside("${CMAKE_CURRENT_LIST_DIR}/headers" "${WORK_DIR}/headers"
                "-DTANDEM_HEADERS_FILE=${headers_list}")
elseif(STEP STREQUAL "programs")
  set(program "${prefix}/bin/train_linear")
  if(NOT EXISTS "${program}")
    message(FATAL_ERROR "no ${program}: the programs are not installed")
  endif()
  run("${program}" --help)
  execute_process(COMMAND "${program}" --gpus=cpu --nprocs=2 --steps=2
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "step:1 loss:")
    message(FATAL_ERROR "installed train_linear failed (${rc}):\n${out}\n${err}")
  endif()
else()
  message(FATAL_ERROR
          "STEP must be install, example, testing, headers or programs, not '${STEP}'")
endif()
